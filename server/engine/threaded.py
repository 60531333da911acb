"""What every engine shares: its own thread, an inbox, one hand-off per step, and failing alone.

The event loop never waits on torch: ``submit`` and ``cancel`` only put a message in the inbox, and the
engine thread drains the inbox between steps, runs one step, and hands every output of that step to the
``on_step`` callback in one call. A request that cannot be read, or a step that raises, ends the affected
requests with an ``error`` output; the thread itself keeps going.

Nothing heavy on that thread but the step: an engine that takes token ids (``takes_ids``) gets them from
``prepare`` (templating, tokenising, fitting to the context), which the worker runs on a pool of its own
before ``submit``; a request submitted without them is prepared on the submitting thread, never here.

Subclasses say what a step is (``_step``), how a request comes in (``_intake``) and goes away
(``_drop``), and whether there is work left (``_has_work``).
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from typing import Any

import structlog

from server.engine.api import GenerationRequest, StepCallback, StepOutput

log = structlog.get_logger(__name__)


def error_output(key: str, offset: int, code: str, message: str) -> StepOutput:
    """A request's last output when it ends in an error (the message is cut to 200 characters)."""
    return StepOutput(key, offset, 0, "", finish="error", error_code=code, error_message=message[:200])


class ThreadedEngine(ABC):
    """The Engine protocol (api.py) on a thread of its own."""

    def __init__(self) -> None:
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._running = False
        self.requests_started = 0  # generations begun: the tests' "generated exactly once" counter
        self.tokens_generated = 0

    # ---- Engine protocol (any thread) ---------------------------------------------------------------

    def start(self, on_step: StepCallback) -> None:
        self._on_step = on_step
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    takes_ids = False  # True: requests reach the engine thread as prompt token ids (see ``prepare``)

    def prepare(self, request: GenerationRequest) -> GenerationRequest:
        """The request as the engine thread takes it (any thread; CPU-bound: call it off the event loop).
        Engines that take token ids fill ``prompt_ids`` here; raises PromptTooLarge."""
        return request

    def submit(self, request: GenerationRequest) -> None:
        if self.takes_ids and request.prompt_ids is None:
            from server.engine.prompt import PromptTooLarge

            try:
                request = self.prepare(request)  # on the caller's thread: the engine thread never tokenises
            except PromptTooLarge as exc:
                out = error_output(request.key, len(request.resume_ids), "too_large", str(exc))
                self._inbox.put(("out", out))
                return
        self._enqueue(request)

    def _enqueue(self, request: GenerationRequest) -> None:
        self._inbox.put(("submit", request))

    def cancel(self, key: str) -> None:
        self._inbox.put(("cancel", key))

    def alive(self) -> bool:
        """Is the engine thread running? (False before start, after stop, or if it died.)"""
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._running = False
        self._inbox.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ---- for subclasses (engine thread) -------------------------------------------------------------

    @abstractmethod
    def _has_work(self) -> bool: ...

    @abstractmethod
    def _intake(self, req: GenerationRequest, outs: list[StepOutput]) -> None:
        """Take a submitted request in; an output that ends it at once (an error) goes to ``outs``."""

    @abstractmethod
    def _drop(self, key: str) -> None:
        """Forget a cancelled request (no output: whoever cancelled has already ended its log)."""

    @abstractmethod
    def _step(self) -> list[StepOutput]:
        """Advance the running requests by one step."""

    @abstractmethod
    def _fail_running(self, exc: Exception) -> list[StepOutput]:
        """After ``_step`` raised: end every running request with an error and start clean."""

    def _taken(self) -> None:
        """A submitted request left the inbox (before ``_intake``)."""
        return  # nothing by default

    def _handed_off(self, seconds: float) -> None:
        """How long the last ``on_step`` call took (the step profile's hand-off)."""
        return  # nothing by default

    def _after_step(self) -> None:
        """Called once per loop turn, after the step (bookkeeping other threads read)."""
        return  # nothing by default

    # ---- the thread ---------------------------------------------------------------------------------

    def _loop(self) -> None:
        import torch  # here, not at the top: a model-free engine (the tests' fake) needs no torch

        torch.set_grad_enabled(False)
        while self._running:
            outs: list[StepOutput] = []
            if self._drain_inbox(outs, block=not self._has_work()):
                return
            if self._has_work():
                try:
                    outs.extend(self._step())
                except Exception as exc:  # never let one bad step kill the engine thread
                    log.exception("engine.step_failed")
                    outs.extend(self._fail_running(exc))
            self._after_step()
            if outs:
                t0 = time.perf_counter()
                try:
                    self._on_step(outs)
                except Exception:  # the receiver's problem (e.g. its loop is closing): keep going
                    log.exception("engine.on_step_failed")
                self._handed_off(time.perf_counter() - t0)

    def _drain_inbox(self, outs: list[StepOutput], *, block: bool) -> bool:
        """Take every waiting message (waiting for one if ``block``); True when told to stop."""
        try:
            while True:
                kind, arg = self._inbox.get(block=block, timeout=None if block else 0)
                block = False
                if kind == "stop":
                    return True
                if kind == "cancel":
                    self._drop(arg)
                    continue
                if kind == "out":  # refused before it reached this thread (too_large)
                    outs.append(arg)
                    continue
                self._taken()
                try:
                    self._intake(arg, outs)
                except Exception as exc:  # a request that cannot even be read fails alone
                    log.exception("engine.intake_failed", key=arg.key)
                    outs.append(error_output(arg.key, len(arg.resume_ids), "internal", f"bad request: {exc}"))
        except queue.Empty:
            return False
