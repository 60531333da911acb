"""The two encodings of protocol v1, one per WebSocket subprotocol.

``tokenwire.v1.msgpack`` carries each frame as one binary WebSocket message holding one msgpack map;
``tokenwire.v1.json`` carries it as one text message holding one JSON object. The schema is the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgpack

from protocol.errors import ErrorCode, ProtocolError

MSGPACK_SUBPROTOCOL = "tokenwire.v1.msgpack"
JSON_SUBPROTOCOL = "tokenwire.v1.json"
SUBPROTOCOLS = (MSGPACK_SUBPROTOCOL, JSON_SUBPROTOCOL)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def unique_keys(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """A map from its key-value pairs (json's and msgpack's ``object_pairs_hook``); ValueError if a key
    repeats, which readers would resolve differently (the first or the last one wins), so that a
    checking proxy and this server could disagree on what a frame says."""
    d = dict(pairs)
    if len(d) != len(pairs):
        raise ValueError("an object repeats a key")
    return d


def json_error(exc: ValueError | RecursionError) -> str:
    """Why ``json.loads`` refused a text, in the protocol's words: Python's own text for an integer of
    more than 4,300 digits names a Python setting, of no use to a client."""
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    if "integer string conversion" in str(exc):
        return "an integer of more than 4300 digits"
    return str(exc)


def unicode_only(obj: object) -> object:
    """``obj`` (parsed JSON) as it is, or ValueError (UnicodeEncodeError) where a string in it holds a
    lone surrogate: JSON escapes ("\\ud800", and json's decoding of bytes) can spell them, and they are
    not Unicode text, so they would fail later, when a reply, a hash or the store encodes the string."""
    json.dumps(obj, ensure_ascii=False).encode("utf-8")
    return obj


@dataclass(frozen=True, slots=True)
class Codec:
    """Encodes maps to WebSocket message payloads and back for one subprotocol."""

    subprotocol: str

    @property
    def binary(self) -> bool:
        return self.subprotocol == MSGPACK_SUBPROTOCOL

    def encode(self, frame: dict[str, Any]) -> bytes | str:
        if self.binary:
            return msgpack.packb(frame, use_bin_type=True)
        return json.dumps(frame, separators=(",", ":"), ensure_ascii=False)

    def decode(self, data: bytes | str) -> object:
        """Decode one WebSocket message into a Python object; ProtocolError(bad_frame) if it is not one."""
        if self.binary:
            if isinstance(data, str):
                raise ProtocolError(
                    ErrorCode.BAD_FRAME, f"text message on {MSGPACK_SUBPROTOCOL}: send binary msgpack frames"
                )
            try:
                return msgpack.unpackb(data, raw=False, strict_map_key=True, object_pairs_hook=unique_keys)
            except Exception as exc:  # msgpack raises several unrelated types for bad input
                raise ProtocolError(ErrorCode.BAD_FRAME, f"invalid msgpack: {exc}"[:200]) from None
        if isinstance(data, bytes):
            raise ProtocolError(
                ErrorCode.BAD_FRAME, f"binary message on {JSON_SUBPROTOCOL}: send text JSON frames"
            )
        try:
            obj = unicode_only(
                json.loads(data, parse_constant=_reject_constant, object_pairs_hook=unique_keys)
            )
        except (ValueError, RecursionError) as exc:
            raise ProtocolError(ErrorCode.BAD_FRAME, f"invalid JSON: {json_error(exc)}"[:200]) from None
        return obj


def codec_for(subprotocol: str) -> Codec:
    if subprotocol not in SUBPROTOCOLS:
        raise ValueError(f"unknown subprotocol {subprotocol!r}; expected one of {SUBPROTOCOLS}")
    return Codec(subprotocol)
