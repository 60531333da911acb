"""Bytes on the wire per streamed token: tokenwire's two subprotocols against an OpenAI-style SSE stream.

Every live ``delta`` the load tool receives is counted three ways, all for the same text and the same
token count:

* **measured**: the WebSocket payload actually received on the subprotocol the connection used, plus the
  2-10 byte frame header (server frames are unmasked);
* **computed** for both subprotocols: the same delta re-encoded with the msgpack and the JSON codec, so a run
  on one subprotocol still gives both figures (and measured == computed checks the arithmetic);
* **SSE**: ``data: {chat.completion.chunk}\\n\\n`` as OpenAI streams it, one chunk per delta with the same
  ``delta.content``; the HTTP/1.1 chunked-encoding framing around each event is reported separately and left
  out of the headline ratio (which makes the comparison conservative for tokenwire).

"Stream" figures add each request's framing: ``accepted`` and ``done`` for tokenwire; the role chunk, the
final chunk with ``finish_reason`` and ``data: [DONE]`` for SSE.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

from protocol import JSON_SUBPROTOCOL, MSGPACK_SUBPROTOCOL, Accepted, Delta, Done, codec_for
from server.load.connection import ws_header_bytes

ENCODINGS = {"msgpack": MSGPACK_SUBPROTOCOL, "json": JSON_SUBPROTOCOL}
_CODECS = {name: codec_for(sub) for name, sub in ENCODINGS.items()}


def sse_id(request_id: str) -> str:
    """An OpenAI-shaped completion id (``chatcmpl-`` and 29 characters), stable per request."""
    return "chatcmpl-" + hashlib.sha256(request_id.encode()).hexdigest()[:29]


def sse_event(
    chunk_id: str, created: int, model: str, delta: dict[str, str], finish_reason: str | None
) -> bytes:
    """One server-sent event carrying an OpenAI ``chat.completion.chunk``."""
    body = {
        "id": chunk_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }
    return b"data: " + json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def chunked_overhead(size: int) -> int:
    """HTTP/1.1 chunked transfer framing around one ``size``-byte chunk: ``<hex>\\r\\n`` ... ``\\r\\n``."""
    return len(f"{size:x}") + 4


def _encoded_size(name: str, wire: dict[str, Any]) -> int:
    data = _CODECS[name].encode(wire)
    return len(data) if isinstance(data, bytes) else len(data.encode())


@dataclass(slots=True)
class Tally:
    frames: int = 0
    payload: int = 0
    framing: int = 0  # WebSocket headers, or chunked-encoding framing for SSE
    tokens: int = 0

    def add(self, payload: int, framing: int, tokens: int) -> None:
        self.frames += 1
        self.payload += payload
        self.framing += framing
        self.tokens += tokens

    def as_dict(self) -> dict[str, float | int | None]:
        per = (lambda b: round(b / self.tokens, 2)) if self.tokens else (lambda b: None)
        return {
            "tokens": self.tokens,
            "frames": self.frames,
            "payload_bytes": self.payload,
            "framing_bytes": self.framing,
            "payload_per_token": per(self.payload),
            "wire_per_token": per(self.payload + self.framing),
        }


class WireStats:
    """Accumulates the byte counts of live streams (not integrity replays)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.created = int(time.time())
        self.measured: dict[str, Tally] = {}
        self.deltas = {name: Tally() for name in (*ENCODINGS, "sse")}
        self.stream = {name: Tally() for name in (*ENCODINGS, "sse")}

    def _both(self, wire: dict[str, Any], tokens: int, *, delta: bool) -> None:
        for name in ENCODINGS:
            size = _encoded_size(name, wire)
            if delta:
                self.deltas[name].add(size, ws_header_bytes(size), tokens)
            self.stream[name].add(size, ws_header_bytes(size), tokens)

    def _sse(self, event: bytes, tokens: int, *, delta: bool) -> None:
        if delta:
            self.deltas["sse"].add(len(event), chunked_overhead(len(event)), tokens)
        self.stream["sse"].add(len(event), chunked_overhead(len(event)), tokens)

    def delta(self, subprotocol: str, size: int, frame: Delta) -> None:
        name = "msgpack" if subprotocol == MSGPACK_SUBPROTOCOL else "json"
        self.measured.setdefault(name, Tally()).add(size, ws_header_bytes(size), frame.n)
        self._both(frame.to_wire(), frame.n, delta=True)
        event = sse_event(sse_id(frame.id), self.created, self.model, {"content": frame.text}, None)
        self._sse(event, frame.n, delta=True)

    def accepted(self, frame: Accepted, *, first: bool) -> None:
        self._both(frame.to_wire(), 0, delta=False)
        if first:  # OpenAI's first chunk announces the role, with empty content
            event = sse_event(
                sse_id(frame.id), self.created, self.model, {"role": "assistant", "content": ""}, None
            )
            self._sse(event, 0, delta=False)

    def done(self, frame: Done) -> None:
        self._both(frame.to_wire(), 0, delta=False)
        reason = frame.finish_reason if frame.finish_reason in ("stop", "length") else "stop"
        self._sse(sse_event(sse_id(frame.id), self.created, self.model, {}, reason), 0, delta=False)
        self._sse(SSE_DONE, 0, delta=False)

    def report(self) -> dict[str, Any]:
        def ratio(name: str, table: dict[str, Tally]) -> float | None:
            ours, sse = table[name], table["sse"]
            if not ours.tokens or not sse.payload:
                return None
            return round((ours.payload + ours.framing) / sse.payload, 4)

        per_token = {name: self.deltas[name].as_dict()["wire_per_token"] for name in ENCODINGS} | {
            "sse": self.deltas["sse"].as_dict()["payload_per_token"]
        }
        return {
            "bytes_per_token": per_token,
            "ratio_to_sse": {name: ratio(name, self.deltas) for name in ENCODINGS},
            "stream_ratio_to_sse": {name: ratio(name, self.stream) for name in ENCODINGS},
            "measured": {name: t.as_dict() for name, t in sorted(self.measured.items())},
            "computed": {name: t.as_dict() for name, t in self.deltas.items()},
            "stream": {name: t.as_dict() for name, t in self.stream.items()},
            "sse_model": self.model,
            "note": (
                "bytes_per_token: msgpack/json = WebSocket payload + frame header per token of live deltas; "
                "sse = 'data: {chat.completion.chunk}\\n\\n' bytes per token for the same delta texts "
                "(HTTP chunked framing excluded). stream_*: with accepted/done resp. role chunk, final "
                "chunk and [DONE]."
            ),
        }
