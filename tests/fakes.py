"""A fake engine with the real engines' threading (it is a ThreadedEngine) and interface, and no model:
the gateway and store are tested against it. It "generates" a deterministic reply derived from the prompt,
one word per step."""

from __future__ import annotations

import time
from dataclasses import dataclass

from server.engine.api import GenerationRequest, StepOutput
from server.engine.threaded import ThreadedEngine, error_output


def reply_words(req: GenerationRequest) -> list[str]:
    """The fake completion: words that depend on the last message, the history length and the seed."""
    last = req.messages[-1]["content"] if req.messages else ""
    words = [f"re[{len(req.messages)}]"] + [f" {w}" for w in last.split()] + [f" s{req.params.seed % 97}"]
    k = 0
    while len(words) < 400:  # long enough for any max_tokens used in tests
        words.append(f" w{k}")
        k += 1
    return words


@dataclass
class _Run:
    req: GenerationRequest
    words: list[str]
    offset: int


class FakeEngine(ThreadedEngine):
    """The real engines' thread, inbox and hand-off (ThreadedEngine); a step emits one word per request."""

    def __init__(self, step_s: float = 0.002, reply_len: int = 12) -> None:
        super().__init__()
        self.step_s = step_s
        self.reply_len = reply_len  # words before a natural "stop" (unless max_tokens is smaller)
        self.pad = ""  # appended to every token's text (tests that need big deltas)
        # The context window, in tokens (prompt, one per message, and completion): a reply that fills it
        # ends "length" with length_reason "context", as a real engine's does. None: no window.
        self.context: int | None = None
        self.started_keys: list[str] = []
        self.resumed_at: list[int] = []  # per start, in order: how many logged tokens it continued after
        self._runs: dict[str, _Run] = {}

    def _has_work(self) -> bool:
        return bool(self._runs)

    def _intake(self, req: GenerationRequest, outs: list[StepOutput]) -> None:
        self.requests_started += 1
        self.started_keys.append(req.key)
        self.resumed_at.append(len(req.resume_ids))
        self._runs[req.key] = _Run(req, reply_words(req), len(req.resume_ids))

    def _drop(self, key: str) -> None:
        self._runs.pop(key, None)

    def _fail_running(self, exc: Exception) -> list[StepOutput]:
        outs = [error_output(k, r.offset, "internal", f"engine error: {exc}") for k, r in self._runs.items()]
        self._runs.clear()
        return outs

    def _step(self) -> list[StepOutput]:
        outs: list[StepOutput] = []
        for key, run in list(self._runs.items()):
            n = len(run.req.messages)
            limit = min(run.req.params.max_tokens, self.reply_len)
            o = run.offset
            finish = None
            why = ""
            if self.context is not None and n + o + 1 >= self.context:
                finish, why = "length", "context"
            elif o + 1 >= limit:
                finish = "length" if run.req.params.max_tokens <= self.reply_len else "stop"
                why = "max_tokens" if finish == "length" else ""
            text = run.words[o] + self.pad
            # The word's index is its token id: logged like a real engine's ids, so a request re-queued
            # after its worker died or shed it continues after its logged tokens (resume_ids) instead of
            # regenerating them over its own log, which the store refuses once steps merge differently.
            # A prompt token per message; every message before the last counts as reused (as a real
            # engine's earlier session turns would), so usage.cached_tokens reaches every door.
            out = StepOutput(
                key, o, 1, text, (o,), finish=finish, prompt_tokens=n, cached_tokens=n - 1, length_reason=why
            )
            outs.append(out)
            run.offset += 1
            if finish:
                del self._runs[key]
        time.sleep(self.step_s)
        return outs
