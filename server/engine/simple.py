"""A first, simple engine: each running sequence advanced one token per step on its own KV cache (batch
of one). Correct and streaming, but it does not batch: the continuous-batching engine replaces it for
Llama-family models, and this one serves any other causal LM transformers can run. Like every engine it
runs on its own thread (threaded.py) so the event loop never waits on torch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from server.engine.api import GenerationRequest, StepOutput, length_reason, resumed_at_end
from server.engine.detok import Detokenizer
from server.engine.model import LoadedModel
from server.engine.penalties import apply_penalties
from server.engine.prompt import PromptTooLarge, checked_ids
from server.engine.sampling import sample
from server.engine.threaded import ThreadedEngine, error_output

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


class SimpleEngine(ThreadedEngine):
    takes_ids = True

    def __init__(self, loaded: LoadedModel, *, max_prompt_tokens: int | None = None) -> None:
        super().__init__()
        self.m = loaded
        ctx = int(getattr(loaded.model.config, "max_position_embeddings", 2048))
        self.max_context = ctx
        self.max_prompt_tokens = min(max_prompt_tokens or ctx, ctx - 1)
        self._seqs: dict[str, _Seq] = {}
        self.prompter = loaded.prompter

    def prepare(self, request: GenerationRequest) -> GenerationRequest:
        """Template, tokenise and fit the messages (off the engine thread). Raises PromptTooLarge."""
        if request.prompt_ids is not None:
            return request
        ids = self.prompter.fit(request.messages, self.max_prompt_tokens)
        return dataclasses.replace(request, messages=[], prompt_ids=ids)

    # ---- engine thread (threaded.py) ----------------------------------------------------------------

    def _has_work(self) -> bool:
        return bool(self._seqs)

    def _drop(self, key: str) -> None:
        self._seqs.pop(key, None)

    def _fail_running(self, exc: Exception) -> list[StepOutput]:
        msg = f"engine error: {exc}"
        outs = [error_output(s.req.key, s.offset, "internal", msg) for s in self._seqs.values()]
        self._seqs.clear()
        return outs

    def _intake(self, req: GenerationRequest, outs: list[StepOutput]) -> None:
        if req.prompt_ids is None:  # submit() prepares every request; nothing is tokenised on this thread
            outs.append(error_output(req.key, len(req.resume_ids), "internal", "request without ids"))
            return
        try:
            ids = checked_ids(req.prompt_ids, self.max_prompt_tokens)
        except PromptTooLarge as exc:
            outs.append(error_output(req.key, len(req.resume_ids), "too_large", str(exc)))
            return
        end = resumed_at_end(req.key, len(req.resume_ids), len(ids), req.params.max_tokens, self.max_context)
        if end is not None:
            outs.append(end)
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
            logits = apply_penalties(
                out.logits[:, -1, :].float(),
                [s.req.params],
                [s.prompt_ids + s.completion],
                [len(s.prompt_ids)],
            )
            token = sample(logits, [s.req.params], [index])[0]
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
        context_full = len(s.prompt_ids) + total >= self.max_context
        n, text, finish = s.detok.push(
            token,
            eos=token in self.m.eos_ids and not p.ignore_eos,
            at_length=total >= p.max_tokens or context_full,
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
            length_reason=length_reason(finish, context_full=context_full),
        )
