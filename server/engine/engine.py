"""The continuous-batching engine: a thread that runs schedule -> run -> postprocess, one batched forward
pass per step, and hands each step's outputs (every sequence's new tokens together) to ``on_step``."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from server.engine import llama
from server.engine.api import Engine, EngineOverloaded, GenerationRequest, StepCallback, StepOutput
from server.engine.model import LoadedModel
from server.engine.prompt import PromptTooLarge, fit_messages
from server.engine.runner import Runner, kv_bytes_per_token
from server.engine.scheduler import QueueFull, Scheduler, SchedulerConfig

log = structlog.get_logger(__name__)

SHORT_SLOT = 512  # tokens per slot of the short pool: most chat turns fit; longer ones move up


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_running: int
    max_context: int
    pools: tuple[tuple[int, int], ...]
    prefill_tokens: int
    max_waiting: int
    prefix_reuse: bool


def engine_for(loaded: LoadedModel, **overrides: Any) -> Engine:
    """The batching engine for Llama-family models; the simple one-sequence-at-a-time engine (slower,
    any causal LM transformers can run) for other architectures."""
    reason = llama.unsupported_reason(loaded.model)
    if reason is None:
        return BatchingEngine(loaded, **overrides)
    from server.engine.simple import SimpleEngine

    log.warning("engine.generic_path", model=loaded.name, reason=reason)
    return SimpleEngine(loaded)


def default_pools(
    bytes_per_token: int, max_context: int, max_running: int, budget_bytes: int, short_len: int = SHORT_SLOT
) -> tuple[tuple[int, int], ...]:
    """Split a KV memory budget into a pool of short slots (every running sequence plus cached session
    prefixes) and a few full-context slots."""
    tokens = max(budget_bytes // bytes_per_token, max_context)
    if max_context <= short_len:
        return ((max(1, min(2 * max_running, tokens // max_context)), max_context),)
    n_long = max(1, min(max(1, max_running // 4), tokens // 4 // max_context))
    n_short = max(1, min(2 * max_running, (tokens - n_long * max_context) // short_len))
    return ((n_short, short_len), (n_long, max_context))


def default_config(
    loaded: LoadedModel,
    *,
    max_running: int | None = None,
    max_context: int | None = None,
    kv_budget_mb: int | None = None,
    pools: tuple[tuple[int, int], ...] | None = None,
    prefill_tokens: int | None = None,
    max_waiting: int = 256,
    prefix_reuse: bool = True,
) -> EngineConfig:
    """Sizes for this model and device; any argument given overrides its default."""
    cuda = str(loaded.device).startswith("cuda")
    model_ctx = int(getattr(loaded.model.config, "max_position_embeddings", 2048))
    running = max_running or (256 if cuda else 32)
    if pools is None:
        ctx = min(model_ctx, max_context or (8192 if cuda else 2048))
        if kv_budget_mb is None:
            if cuda:
                free, _ = torch.cuda.mem_get_info(torch.device(loaded.device))
                kv_budget_mb = min(free // 2, 32 << 30) >> 20
            else:
                kv_budget_mb = 1024
        per_token = kv_bytes_per_token(loaded.model, loaded.dtype)
        pools = default_pools(per_token, ctx, running, kv_budget_mb << 20)
    return EngineConfig(
        max_running=running,
        max_context=max(length for _, length in pools),
        pools=pools,
        # CPU: prefill costs ~1.3 ms a token on SmolLM2 here, so 256 bounds a step near a third of a second.
        prefill_tokens=prefill_tokens or (2048 if cuda else 256),
        max_waiting=max_waiting,
        prefix_reuse=prefix_reuse,
    )


class BatchingEngine:
    """Engine protocol (api.py) over a Scheduler and a Runner, on its own thread."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None, **overrides: Any) -> None:
        self.m = loaded
        self.config = config or default_config(loaded, **overrides)
        self.max_context = self.config.max_context
        self.max_prompt_tokens = self.config.max_context - 1
        self.runner = Runner(loaded.model, self.config.pools, device=loaded.device, dtype=loaded.dtype)
        self.sched = self._new_scheduler()
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._running = False
        self._lock = threading.Lock()
        self._inbox_submits = 0  # submitted, not yet taken by the engine thread
        self._sched_waiting = 0  # new requests waiting in the scheduler (engine thread's view)
        self.requests_started = 0  # generations begun: the tests' "generated exactly once" counter
        self.tokens_generated = 0
        self.steps = 0
        self.step_seconds = 0.0  # time inside steps (forward + sampling + bookkeeping)

    def _new_scheduler(self) -> Scheduler:
        c = self.config
        cfg = SchedulerConfig(
            pools=c.pools,
            max_running=c.max_running,
            prefill_tokens=c.prefill_tokens,
            max_waiting=c.max_waiting,
            eos_ids=self.m.eos_ids,
            prefix_reuse=c.prefix_reuse,
        )
        return Scheduler(cfg, self.m.decode)

    # ---- Engine protocol (any thread) ---------------------------------------------------------------

    def start(self, on_step: StepCallback) -> None:
        self._on_step = on_step
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request; raises EngineOverloaded (nothing queued) when the waiting queue is full."""
        with self._lock:
            if self._inbox_submits + self._sched_waiting >= self.config.max_waiting:
                raise EngineOverloaded(self.retry_after_ms())
            self._inbox_submits += 1
        self._inbox.put(("submit", request))

    def cancel(self, key: str) -> None:
        self._inbox.put(("cancel", key))

    def stop(self) -> None:
        self._running = False
        self._inbox.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout=10)

    def retry_after_ms(self) -> int:
        """Estimated wait until the waiting queue has room again."""
        return self.sched.retry_after_ms()

    # ---- engine thread -----------------------------------------------------------------------------

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while self._running:
            outs: list[StepOutput] = []
            block = not self.sched.has_work()
            try:
                while True:
                    kind, arg = self._inbox.get(block=block, timeout=None if block else 0)
                    block = False
                    if kind == "stop":
                        return
                    if kind == "cancel":
                        self.sched.cancel(arg)
                    else:
                        with self._lock:
                            self._inbox_submits -= 1
                        try:
                            self._intake(arg, outs)
                        except Exception as exc:  # a request that cannot even be read fails alone
                            log.exception("engine.intake_failed", key=arg.key)
                            outs.append(
                                _error(arg.key, len(arg.resume_ids), "internal", f"bad request: {exc}")
                            )
            except queue.Empty:
                pass
            if self.sched.has_work():
                outs.extend(self._step())
            with self._lock:
                self._sched_waiting = self.sched.new_waiting()
            if outs:
                try:
                    self._on_step(outs)
                except Exception:  # the receiver's problem (e.g. its loop is closing): keep going
                    log.exception("engine.on_step_failed")

    def _step(self) -> list[StepOutput]:
        t0 = time.perf_counter()
        try:
            batch = self.sched.schedule()
            tokens = self.runner.step(batch)
            outs = self.sched.postprocess(batch, tokens)
        except Exception as exc:  # never let one bad step kill the engine thread
            log.exception("engine.step_failed")
            outs = [
                _error(s.key, s.offset, "internal", f"engine error: {exc}") for s in self.sched.finish_all()
            ]
            self.sched = self._new_scheduler()  # the slot table may be half-updated: start clean
            return outs
        self.tokens_generated += len(tokens)
        self.steps += 1
        self.step_seconds += time.perf_counter() - t0
        return outs

    def _intake(self, req: GenerationRequest, outs: list[StepOutput]) -> None:
        start = len(req.resume_ids)
        try:
            if req.prompt_ids is not None:
                ids = [int(t) for t in req.prompt_ids]
                if not all(0 <= t < self.runner.shape.vocab for t in ids):
                    raise ValueError("prompt_ids outside the vocabulary")
                if len(ids) > self.max_prompt_tokens:
                    raise PromptTooLarge(f"prompt is {len(ids)} tokens; at most {self.max_prompt_tokens}")
            else:
                ids = fit_messages(req.messages, self.m.encode_chat, self.max_prompt_tokens)
        except PromptTooLarge as exc:
            outs.append(_error(req.key, start, "too_large", str(exc)))
            return
        if start >= req.params.max_tokens or len(ids) + start >= self.max_context:
            # Resumed at (or past) its end: nothing left to generate.
            outs.append(StepOutput(req.key, start, 0, "", finish="length", prompt_tokens=len(ids)))
            return
        try:
            self.sched.add(req.key, ids, req.params, resume_ids=req.resume_ids, session=req.session)
        except QueueFull as exc:  # submit() keeps the queue under its bound; a race may still land here
            outs.append(_error(req.key, start, "overloaded", str(exc)))
            return
        self.requests_started += 1


def _error(key: str, offset: int, code: str, message: str) -> StepOutput:
    return StepOutput(key, offset, 0, "", finish="error", error_code=code, error_message=message[:200])
