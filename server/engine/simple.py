"""A first, simple engine: one thread, each running sequence advanced one token per step on its own
KV cache (batch of one). Correct and streaming, but it does not batch; the continuous-batching engine
replaces it. It runs on its own thread so the event loop never waits on torch."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from server.engine.api import GenerationRequest, StepCallback, StepOutput
from server.engine.detok import Detokenizer
from server.engine.model import LoadedModel
from server.engine.prompt import PromptTooLarge, fit_messages
from server.engine.sampling import sample

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class _Seq:
    req: GenerationRequest
    prompt_ids: list[int]
    detok: Detokenizer
    offset: int  # tokens emitted so far (including resumed ones)
    generated: int = 0  # tokens generated in this run (counts against max_tokens with resumed ones)
    cache: Any = None
    next_input: list[int] = field(default_factory=list)
    completion: list[int] = field(default_factory=list)  # every completion token id, resumed ones first


class SimpleEngine:
    def __init__(self, loaded: LoadedModel, *, max_prompt_tokens: int | None = None) -> None:
        self.m = loaded
        ctx = int(getattr(loaded.model.config, "max_position_embeddings", 2048))
        self.max_context = ctx
        self.max_prompt_tokens = min(max_prompt_tokens or ctx, ctx - 1)
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._running = False
        self._seqs: dict[str, _Seq] = {}
        self.requests_started = 0  # generations begun: the tests' "generated exactly once" counter
        self.tokens_generated = 0

    def start(self, on_step: StepCallback) -> None:
        self._on_step = on_step
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest) -> None:
        self._inbox.put(("submit", request))

    def cancel(self, key: str) -> None:
        self._inbox.put(("cancel", key))

    def stop(self) -> None:
        self._running = False
        self._inbox.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ---- engine thread -------------------------------------------------------------------------

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while self._running:
            block = not self._seqs
            try:
                while True:
                    kind, arg = self._inbox.get(block=block, timeout=None if block else 0)
                    block = False
                    if kind == "stop":
                        return
                    if kind == "cancel":
                        self._seqs.pop(arg, None)
                    else:
                        self._admit(arg)
            except queue.Empty:
                pass
            if self._seqs:
                try:
                    outs = self._step()
                except Exception as exc:  # never let one bad step kill the engine thread
                    log.exception("engine.step_failed")
                    outs = [
                        StepOutput(
                            s.req.key,
                            s.offset,
                            0,
                            "",
                            finish="error",
                            error_code="internal",
                            error_message=f"engine error: {exc}"[:200],
                        )
                        for s in self._seqs.values()
                    ]
                    self._seqs.clear()
                if outs:
                    self._on_step(outs)

    def _admit(self, req: GenerationRequest) -> None:
        try:
            if req.prompt_ids is not None:
                ids = list(req.prompt_ids)
                if len(ids) > self.max_prompt_tokens:
                    raise PromptTooLarge(f"prompt is {len(ids)} tokens; at most {self.max_prompt_tokens}")
            else:
                ids = fit_messages(req.messages, self.m.encode_chat, self.max_prompt_tokens)
        except PromptTooLarge as exc:
            self._on_step(
                [
                    StepOutput(
                        req.key,
                        len(req.resume_ids),
                        0,
                        "",
                        finish="error",
                        error_code="too_large",
                        error_message=str(exc),
                    )
                ]
            )
            return
        detok = Detokenizer(self.m.decode, req.params.stop)
        detok.prime(req.resume_ids)
        seq = _Seq(
            req,
            ids,
            detok,
            offset=len(req.resume_ids),
            next_input=ids + list(req.resume_ids),
            completion=list(req.resume_ids),
        )
        self._seqs[req.key] = seq
        self.requests_started += 1

    def _step(self) -> list[StepOutput]:
        outs: list[StepOutput] = []
        finished: list[str] = []
        for key, s in self._seqs.items():
            ids = torch.tensor([s.next_input], device=self.m.device)
            out = self.m.model(input_ids=ids, cache=s.cache, use_cache=True, logits_to_keep=1)
            s.cache = out.cache
            index = len(s.req.resume_ids) + s.generated  # this token's offset in the completion
            token = sample(out.logits[:, -1, :], [s.req.params], [index])[0]
            s.next_input = [token]
            s.completion.append(token)
            s.generated += 1
            self.tokens_generated += 1
            o = self._post(s, token)
            if o is not None:
                outs.append(o)
                if o.finish is not None:
                    finished.append(key)
        for key in finished:
            del self._seqs[key]
        return outs

    def _post(self, s: _Seq, token: int) -> StepOutput | None:
        p = s.req.params
        total = len(s.req.resume_ids) + s.generated
        start = s.offset
        n, text, finish = s.detok.push(
            token,
            eos=token in self.m.eos_ids and not p.ignore_eos,
            at_length=total >= p.max_tokens or len(s.prompt_ids) + total >= self.max_context,
        )
        if n == 0 and finish is None:
            return None
        s.offset += n
        return StepOutput(
            s.req.key,
            start,
            n,
            text,
            token_ids=tuple(s.completion[start : start + n]),
            finish=finish,
            prompt_tokens=len(s.prompt_ids),
        )
