"""A fake engine with the real engine's threading and interface, and no model: the gateway and store are
tested against it. It "generates" a deterministic reply derived from the prompt, one word per step."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

from server.engine.api import GenerationRequest, StepCallback, StepOutput


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


class FakeEngine:
    def __init__(self, step_s: float = 0.002, reply_len: int = 12) -> None:
        self.step_s = step_s
        self.reply_len = reply_len  # words before a natural "stop" (unless max_tokens is smaller)
        self.pad = ""  # appended to every token's text (tests that need big deltas)
        self.requests_started = 0
        self.started_keys: list[str] = []
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._runs: dict[str, _Run] = {}
        self._thread: threading.Thread | None = None
        self._running = False

    def start(self, on_step: StepCallback) -> None:
        self._on_step = on_step
        self._running = True
        self._thread = threading.Thread(target=self._loop, daemon=True, name="fake-engine")
        self._thread.start()

    def submit(self, request: GenerationRequest) -> None:
        self._inbox.put(("submit", request))

    def cancel(self, key: str) -> None:
        self._inbox.put(("cancel", key))

    def stop(self) -> None:
        self._running = False
        self._inbox.put(("stop", None))
        if self._thread:
            self._thread.join(5)

    def _loop(self) -> None:
        while self._running:
            try:
                block = not self._runs
                while True:
                    kind, arg = self._inbox.get(block=block)
                    block = False
                    if kind == "stop":
                        return
                    if kind == "cancel":
                        self._runs.pop(str(arg), None)
                    else:
                        assert isinstance(arg, GenerationRequest)
                        self.requests_started += 1
                        self.started_keys.append(arg.key)
                        self._runs[arg.key] = _Run(arg, reply_words(arg), len(arg.resume_ids))
            except queue.Empty:
                pass
            outs: list[StepOutput] = []
            for key, run in list(self._runs.items()):
                limit = min(run.req.params.max_tokens, self.reply_len)
                o = run.offset
                finish = None
                if o + 1 >= limit:
                    finish = "length" if run.req.params.max_tokens <= self.reply_len else "stop"
                text = run.words[o] + self.pad
                outs.append(StepOutput(key, o, 1, text, finish=finish, prompt_tokens=len(run.req.messages)))
                run.offset += 1
                if finish:
                    del self._runs[key]
            if outs:
                self._on_step(outs)
            time.sleep(self.step_s)
