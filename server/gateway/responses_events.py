"""The Responses API's objects and events, shared by both of its doors (SSE in openai_responses.py, the
WebSocket mode in openai_responses_ws.py), and the one place where a ``sequence_number`` maps onto a
token offset.

**Sequence numbers** (SPEC.md §15.5). Every event of a response has a unique number, strictly
increasing from 0, as OpenAI defines them, and a number still says exactly how much text a client
holds, so ``starting_after=N`` (or the WebSocket reconnect's ``tw_resume``) continues on any gateway
with nothing repeated and nothing skipped:

* the four opening events are 0, 1, 2, 3;
* a ``response.output_text.delta`` whose text ends at token offset ``e`` (exclusive) is ``3 + e``: a
  delta covers at least one token, so deltas are unique and increasing however the log is packed into
  them (a catch-up packs many tokens into one delta, which only leaves gaps between numbers);
* the closing events of a response of ``T`` tokens are ``3 + T + 1`` onwards, in their fixed order.

This module is pure (no I/O): a door feeds it log entries and sends what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.store.logs import LogEntry

PREFIX = "resp_"
STATUS = {"queued": "queued", "running": "in_progress", "failed": "failed", "cancelled": "cancelled"}
OPENING = (
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
)
# After the last delta: these four for a response that ended normally (the last one is
# response.completed or response.incomplete), or response.failed alone.
CLOSING = ("response.output_text.done", "response.content_part.done", "response.output_item.done", "end")
_BASE = len(OPENING) - 1  # a delta ending at token e is _BASE + e


def delta_seq(end: int) -> int:
    """The sequence number of a delta whose text ends at token offset ``end`` (``end`` ≥ 1)."""
    return _BASE + end


def closing_seq(total: int, k: int) -> int:
    """The sequence number of the ``k``-th closing event (from 0) of a response of ``total`` tokens."""
    return _BASE + total + 1 + k


def last_seq(total: int, ok: bool) -> int:
    """The last sequence number of an ended response: its ``response.completed``/``incomplete`` (``ok``)
    or its ``response.failed``."""
    return closing_seq(total, len(CLOSING) - 1 if ok else 0)


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where a stream resumed after sequence number N starts: ``opening`` opening events already seen,
    text from token ``offset``, ``closing`` closing events already seen."""

    opening: int = 0
    offset: int = 0
    closing: int = 0


MAX_SEQ_DIGITS = 12


def parse_seq(raw: str) -> int | None:
    """A sequence number as a client writes it in a query (``starting_after``, ``tw_resume``), or None:
    ASCII digits only (str.isdigit() alone also takes U+00B2, which int() refuses, and other scripts'
    digits, which it reads), at most MAX_SEQ_DIGITS of them."""
    if not (raw.isascii() and raw.isdigit()) or len(raw) > MAX_SEQ_DIGITS:
        return None
    return int(raw)


def resume_point(after: int | None, tokens: int, ended: bool, ok: bool = True) -> ResumePoint:
    """The resume point after sequence number ``after`` (None: from the start) of a response that has
    ``tokens`` tokens so far (``ended``: and no more; ``ok``: it ended normally). Raises ValueError for a
    number that response never had (past what it has so far, or negative)."""
    if after is None:
        return ResumePoint()
    if after < 0:
        raise ValueError("a non-negative integer")
    if after < len(OPENING):
        return ResumePoint(after + 1, 0, 0)
    offset = after - _BASE
    if offset <= tokens:
        return ResumePoint(len(OPENING), offset, 0)
    if ended and after <= last_seq(tokens, ok):
        return ResumePoint(len(OPENING), tokens, after - closing_seq(tokens, 0) + 1)
    last = last_seq(tokens, ok) if ended else delta_seq(tokens)
    raise ValueError(f"{after} is past this response's last event so far ({last})")


class NotABoundary(ValueError):
    """The resume point falls inside one log entry: the text before it cannot be cut there."""


def status_of(state: str, finish: str | None) -> str:
    if state == "done":
        return "incomplete" if finish == "length" else "completed"
    return STATUS.get(state, "in_progress")


def error_of(code: str, message: str) -> dict[str, str]:
    return {"code": code or "server_error", "message": message or "generation failed"}


def response_object(
    rid: str,
    payload: dict[str, Any],
    status: str,
    text: str,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    error: dict[str, str] | None = None,
    *,
    cached_tokens: int = 0,
    message: bool = True,
) -> dict[str, Any]:
    """The response object in OpenAI's shape; ``message``: whether it has an output message at all (a
    warm-up, ``generate: false``, has none); ``cached_tokens``: of the prompt tokens, those the engine
    reused (``usage.input_tokens_details.cached_tokens``)."""
    final = status in ("completed", "incomplete", "failed", "cancelled")
    output = []
    if message and (text or (final and status != "failed")):
        output.append(
            {
                "type": "message",
                "id": f"msg_{rid[len(PREFIX) :]}",
                "status": "in_progress"
                if not final
                else ("incomplete" if status != "completed" else "completed"),
                "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
            }
        )
    return {
        "id": rid,
        "object": "response",
        "created_at": payload.get("created", 0),
        "status": status,
        "background": bool(payload.get("background")),
        "model": payload.get("model", ""),
        "instructions": payload.get("instructions"),
        "previous_response_id": payload.get("previous_response_id"),
        "max_output_tokens": payload.get("max_output_tokens"),
        "temperature": payload.get("temperature"),
        "top_p": payload.get("top_p"),
        "metadata": payload.get("metadata") or {},
        "prompt_cache_key": payload.get("prompt_cache_key"),
        "safety_identifier": payload.get("safety_identifier"),
        "user": payload.get("user"),
        "output": output,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "usage": {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens,
        }
        if final
        else None,
        "parallel_tool_calls": False,
        "tool_choice": "auto",
        "tools": [],
        "text": {"format": {"type": "text"}},
    }


class ResponseEvents:
    """The events of one response's stream, from the start or resumed at ``at``: :meth:`opening` first,
    then :meth:`feed` with each batch of its log *from token 0* (the closing events need the whole
    text; only text from ``at.offset`` on is sent). ``extra`` goes into every event (the WebSocket
    lane's ``stream_id``)."""

    def __init__(
        self,
        rid: str,
        payload: dict[str, Any],
        state: str,
        at: ResumePoint = ResumePoint(),
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.rid = rid
        self.payload = payload
        self.state = state
        self.at = at
        self.extra = extra or {}
        self.item_id = f"msg_{rid[len(PREFIX) :]}"
        self.text: list[str] = []
        self.ended = False

    def _ev(self, kind: str, seq: int, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": seq, **fields, **self.extra}

    def opening(self) -> list[dict[str, Any]]:
        snapshot = response_object(self.rid, self.payload, STATUS.get(self.state, "in_progress"), "")
        item = {
            "type": "message",
            "id": self.item_id,
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        at = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        events = [
            self._ev(OPENING[0], 0, response=snapshot),
            self._ev(OPENING[1], 1, response={**snapshot, "status": "in_progress"}),
            self._ev(OPENING[2], 2, output_index=0, item=item),
            self._ev(OPENING[3], 3, **at, part=part),
        ]
        return events[self.at.opening :]

    def feed(self, batch: list[LogEntry]) -> list[dict[str, Any]]:
        """The events for the next batch of log entries (contiguous with the previous batch). Raises
        NotABoundary when the resume offset falls inside an entry."""
        start = self.at.offset
        out: list[str] = []
        end = None
        for e in batch:
            if e.finish is not None:
                end = e
                continue
            self.text.append(e.text)
            if e.offset >= start:
                out.append(e.text)
            elif e.offset + e.n > start:
                raise NotABoundary(f"{delta_seq(start)} is not at a delta boundary of this response")
        events = []
        if out:
            last = next(e for e in reversed(batch) if e.finish is None)
            events.append(
                self._ev(
                    "response.output_text.delta",
                    delta_seq(last.offset + last.n),
                    item_id=self.item_id,
                    output_index=0,
                    content_index=0,
                    delta="".join(out),
                    logprobs=[],
                )
            )
        if end is not None:
            events.extend(self._closing(end))
        return events

    def _closing(self, end: LogEntry) -> list[dict[str, Any]]:
        self.ended = True
        full = "".join(self.text)
        total = end.offset
        ok = end.finish in ("stop", "length")
        if ok:
            status = "incomplete" if end.finish == "length" else "completed"
        else:
            status = "cancelled" if end.finish == "cancelled" else "failed"
        error = error_of(end.error_code, end.error_message) if status == "failed" else None
        final = response_object(
            self.rid,
            self.payload,
            status,
            full,
            end.prompt_tokens,
            total,
            error,
            cached_tokens=end.cached_tokens,
        )
        if ok:
            part = {"type": "output_text", "text": full, "annotations": [], "logprobs": []}
            at = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
            events = [
                self._ev(CLOSING[0], closing_seq(total, 0), **at, text=full, logprobs=[]),
                self._ev(CLOSING[1], closing_seq(total, 1), **at, part=part),
                self._ev(CLOSING[2], closing_seq(total, 2), output_index=0, item=final["output"][0]),
                self._ev(f"response.{status}", closing_seq(total, 3), response=final),
            ]
        else:
            events = [self._ev("response.failed", closing_seq(total, 0), response=final)]
        return events[self.at.closing :]
