"""The continuous-batching engine: a thread that runs schedule -> run -> postprocess, one batched forward
pass per step, and hands each step's outputs (every sequence's new tokens together) to ``on_step``."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from server.engine import llama
from server.engine.api import (
    PROMPT_SHARING,
    Engine,
    EngineOverloaded,
    GenerationRequest,
    StepOutput,
    resumed_at_end,
)
from server.engine.model import LoadedModel
from server.engine.profile import StepProfile
from server.engine.prompt import PromptTooLarge, checked_ids
from server.engine.runner import Runner, kv_bytes_per_token
from server.engine.scheduler import QueueFull, Scheduler, SchedulerConfig, common_prefix
from server.engine.threaded import ThreadedEngine, error_output

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
    fair: bool = True  # token-weighted fair queueing across users (False: FIFO)
    prefill_tokens_decoding: int | None = None  # the prefill budget while anything decodes (None: the same)
    # Leading prompt tokens whose KV a new sequence copies from another that holds them, when at least
    # this many (0: off; SchedulerConfig.share_min_tokens): a copy costs far less than feeding 8 tokens.
    share_min_tokens: int = 8
    share_across_users: bool = False  # any common start across users, not only the public prefix


def engine_for(loaded: LoadedModel, **overrides: Any) -> Engine:
    """The batching engine for Llama-family models; the simple one-sequence-at-a-time engine (slower,
    any causal LM transformers can run) for other architectures."""
    reason = llama.unsupported_reason(loaded.model)
    if reason is None:
        return BatchingEngine(loaded, **overrides)
    overrides.pop("one_copy", None)  # the generic path runs the model itself: its weights stay
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


def cpu_kv_budget_mb() -> int:
    """The default KV budget on CPU: 1 GiB, or an eighth of the machine's memory when that is less (a
    2 GiB machine gets 256 MiB), so the default fits small machines. ``--kv-budget-mb`` overrides it."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1024
    return max(128, min(1024, (total >> 20) // 8))


def default_config(
    loaded: LoadedModel,
    *,
    max_running: int | None = None,
    max_context: int | None = None,
    kv_budget_mb: int | None = None,
    pools: tuple[tuple[int, int], ...] | None = None,
    prefill_tokens: int | None = None,
    prefill_tokens_decoding: int | None = None,
    max_waiting: int = 256,
    prefix_reuse: bool = True,
    fair: bool = True,
    prompt_sharing: str = "public",
) -> EngineConfig:
    """Sizes for this model and device; any argument given overrides its default. ``prompt_sharing``
    (PROMPT_SHARING): which sequences may copy each other's prompt starts."""
    if prompt_sharing not in PROMPT_SHARING:
        raise ValueError(f"prompt sharing {prompt_sharing!r}: one of {', '.join(PROMPT_SHARING)}")
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
                kv_budget_mb = cpu_kv_budget_mb()
        per_token = kv_bytes_per_token(loaded.model, loaded.dtype)
        pools = default_pools(per_token, ctx, running, kv_budget_mb << 20)
    budget = prefill_tokens or (2048 if cuda else 256)
    return EngineConfig(
        max_running=running,
        max_context=max(length for _, length in pools),
        pools=pools,
        # CPU: prefill costs ~0.5-1.3 ms a token on SmolLM2 here, so 256 bounds a step near a third of a
        # second; while others stream, 128 halves the longest gap a long prompt puts between their tokens.
        prefill_tokens=budget,
        prefill_tokens_decoding=prefill_tokens_decoding or (None if cuda else min(budget, 128)),
        max_waiting=max_waiting,
        prefix_reuse=prefix_reuse,
        fair=fair,
        share_min_tokens=0 if prompt_sharing == "off" else 8,
        share_across_users=prompt_sharing == "tenant",
    )


def public_prefix(loaded: LoadedModel) -> tuple[int, ...]:
    """The tokens every templated prompt starts with whatever its messages say (the chat template's own
    opening, e.g. SmolLM2's default system prompt: 24 tokens): two one-message chats' common prefix.
    Prompts share their KV across users up to here only (SchedulerConfig.public_prefix)."""
    try:
        a = loaded.encode_chat([{"role": "user", "content": "a"}])
        b = loaded.encode_chat([{"role": "user", "content": "b"}])
    except Exception as exc:  # a tokenizer without a chat template: nothing is shared across users
        log.warning("engine.no_public_prefix", error=repr(exc))
        return ()
    return tuple(a[: common_prefix(a, b, len(a))])


class BatchingEngine(ThreadedEngine):
    """Engine protocol (api.py) over a Scheduler and a Runner, on its own thread (threaded.py)."""

    takes_ids = True

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig | None = None,
        *,
        one_copy: bool = False,
        **overrides: Any,
    ) -> None:
        """``one_copy``: the engine becomes the only user of the model's linear weights, which are then
        kept once, as oneDNN's packed copies on CPU (serving does this; the bench, which also runs
        transformers on the same model, does not)."""
        super().__init__()
        self.m = loaded
        self.config = config or default_config(loaded, **overrides)
        self.max_context = self.config.max_context
        self.max_prompt_tokens = self.config.max_context - 1
        self.prompter = loaded.prompter  # built here, once, not lazily on a pool thread
        self.runner = Runner(
            loaded.model,
            self.config.pools,
            device=loaded.device,
            dtype=loaded.dtype,
            keep_plain=not one_copy,
            decode_kernel=loaded.decode_kernel,
            int4=loaded.int4,
            int4_rows=loaded.int4_rows,
        )
        if one_copy:
            self.runner.weights, freed = llama.release_model_linears(loaded.model, self.runner.weights)
            log.info("engine.weights_released", mb=freed >> 20)
        self._public_prefix = public_prefix(loaded)
        self.sched = self._new_scheduler()
        self._lock = threading.Lock()
        self._reused_before = (0, 0)  # (session, shared) counts of schedulers replaced after a failure
        self._inbox_submits = 0  # submitted, not yet taken by the engine thread
        self._sched_waiting = 0  # new requests waiting in the scheduler (engine thread's view)
        self.steps = 0
        self.step_seconds = 0.0  # time inside steps (forward + sampling + bookkeeping)
        self._kv_usage = 0.0  # read by the worker's gauge from another thread: a float, set per step
        self.profile: StepProfile | None = None  # set by the bench: per-step phase times

    def _new_scheduler(self) -> Scheduler:
        c = self.config
        cfg = SchedulerConfig(
            pools=c.pools,
            max_running=c.max_running,
            prefill_tokens=c.prefill_tokens,
            prefill_tokens_decoding=c.prefill_tokens_decoding,
            max_waiting=c.max_waiting,
            eos_ids=self.m.eos_ids,
            prefix_reuse=c.prefix_reuse,
            fair=c.fair,
            borrow_rows=max(1, c.max_running // 8),  # a light user's chat runs at once, the batch 1/8 over
            share_min_tokens=c.share_min_tokens,
            public_prefix=self._public_prefix,
            share_across_users=c.share_across_users,
        )
        return Scheduler(cfg, self.m.decode)

    # ---- Engine protocol (any thread) ---------------------------------------------------------------

    def prepare(self, request: GenerationRequest) -> GenerationRequest:
        """Template, tokenise and fit the request's messages (any thread but the engine's); the messages
        are dropped from the prepared request. Raises PromptTooLarge."""
        if request.prompt_ids is not None:
            return request
        ids = self.prompter.fit(request.messages, self.max_prompt_tokens)
        return dataclasses.replace(request, messages=[], prompt_ids=ids)

    def _enqueue(self, request: GenerationRequest) -> None:
        """Queue a request; raises EngineOverloaded (nothing queued) when the waiting queue is full."""
        with self._lock:
            if self._inbox_submits + self._sched_waiting >= self.config.max_waiting:
                raise EngineOverloaded(self.retry_after_ms())
            self._inbox_submits += 1
        super()._enqueue(request)

    def retry_after_ms(self) -> int:
        """Estimated wait until the waiting queue has room again."""
        return self.sched.retry_after_ms()

    # ---- engine thread -----------------------------------------------------------------------------

    def _has_work(self) -> bool:
        return self.sched.has_work()

    def _drop(self, key: str) -> None:
        self.sched.cancel(key)

    def _taken(self) -> None:
        with self._lock:
            self._inbox_submits -= 1

    def kv_usage(self) -> float:
        """Share of the KV cache in use after the last step (the tokenwire_kv_cache_usage_ratio gauge)."""
        return self._kv_usage

    def prompt_tokens_reused(self) -> dict[str, int]:
        """Prompt tokens not fed since start, by where their KV came from: the session's cached prefix or
        another sequence's prompt start (tokenwire_prompt_tokens_reused_total; any thread)."""
        with self._lock:
            session, shared = self._reused_before
            sched = self.sched
            return {"session": session + sched.reused_tokens, "shared": shared + sched.shared_tokens}

    def _after_step(self) -> None:
        with self._lock:
            self._sched_waiting = self.sched.new_waiting()
        self._kv_usage = self.sched.table.usage()

    def _step(self) -> list[StepOutput]:
        prof = self.profile
        if prof is not None:
            return self._profiled_step(prof)
        t0 = time.perf_counter()
        batch = self.sched.schedule()
        tokens = self.runner.step(batch)
        outs = self.sched.postprocess(batch, tokens)
        self.tokens_generated += len(tokens)
        self.steps += 1
        self.step_seconds += time.perf_counter() - t0
        return outs

    def _profiled_step(self, prof: StepProfile) -> list[StepOutput]:
        prof.begin()
        batch = self.sched.schedule()
        prof.lap("schedule")
        tokens = self.runner.step(batch, prof.lap)
        outs = self.sched.postprocess(batch, tokens)
        prof.lap("postprocess")
        decode = [w for w in batch.work if w.n == 1]
        # A decode row attends over its whole live KV, the new token's included: start + 1 positions.
        prof.end(len(decode), sum(w.n for w in batch.work) - len(decode), sum(w.start + 1 for w in decode))
        self.tokens_generated += len(tokens)
        self.steps += 1
        self.step_seconds += prof.steps[-1].seconds
        return outs

    def _handed_off(self, seconds: float) -> None:
        if self.profile is not None:
            self.profile.add_to_last("hand-off", seconds)

    def _fail_running(self, exc: Exception) -> list[StepOutput]:
        outs = [
            error_output(s.key, s.offset, "internal", f"engine error: {exc}") for s in self.sched.finish_all()
        ]
        fresh = self._new_scheduler()  # the slot table may be half-updated: start clean
        with self._lock:  # the reuse counts carry over, never seen twice or going back
            session, shared = self._reused_before
            self._reused_before = (session + self.sched.reused_tokens, shared + self.sched.shared_tokens)
            self.sched = fresh
        return outs

    def _intake(self, req: GenerationRequest, outs: list[StepOutput]) -> None:
        start = len(req.resume_ids)
        if req.prompt_ids is None:  # submit() prepares every request; nothing is tokenised on this thread
            outs.append(error_output(req.key, start, "internal", "request reached the engine without ids"))
            return
        try:
            ids = checked_ids(req.prompt_ids, self.max_prompt_tokens, self.runner.shape.vocab)
        except PromptTooLarge as exc:
            outs.append(error_output(req.key, start, "too_large", str(exc)))
            return
        end = resumed_at_end(req.key, start, len(ids), req.params.max_tokens, self.max_context)
        if end is not None:
            outs.append(end)
            return
        try:
            self.sched.add(
                req.key,
                ids,
                req.params,
                resume_ids=req.resume_ids,
                session=req.session,
                user=req.user,
                weight=req.weight,
                cache_key=req.cache_key,
            )
        except QueueFull as exc:  # submit() keeps the queue under its bound; a race may still land here
            outs.append(error_output(req.key, start, "overloaded", str(exc)))
            return
        self.requests_started += 1
