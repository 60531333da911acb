"""tokenwire wire protocol v1: frames, validation, codecs and a sans-I/O connection.

Nothing here does I/O or imports asyncio; the gateway and the clients move bytes, this package decides
what they mean. ``protocol/SPEC.md`` is the normative text.
"""

from __future__ import annotations

from protocol.codec import JSON_SUBPROTOCOL, MSGPACK_SUBPROTOCOL, SUBPROTOCOLS, Codec, codec_for
from protocol.errors import CloseCode, ErrorCode, ProtocolError
from protocol.frames import (
    PROTOCOL_VERSION,
    Accepted,
    Cancel,
    Chat,
    ClientFrame,
    Delta,
    Done,
    Error,
    Hello,
    Message,
    Params,
    Ping,
    Pong,
    Resume,
    ResumePoint,
    ServerFrame,
    Usage,
    Waiting,
    Welcome,
    parse_client_frame,
    parse_server_frame,
)

__all__ = [
    "JSON_SUBPROTOCOL",
    "MSGPACK_SUBPROTOCOL",
    "PROTOCOL_VERSION",
    "SUBPROTOCOLS",
    "Accepted",
    "Cancel",
    "Chat",
    "ClientFrame",
    "CloseCode",
    "Codec",
    "Delta",
    "Done",
    "Error",
    "ErrorCode",
    "Hello",
    "Message",
    "Params",
    "Ping",
    "Pong",
    "ProtocolError",
    "Resume",
    "ResumePoint",
    "ServerFrame",
    "Usage",
    "Waiting",
    "Welcome",
    "codec_for",
    "parse_client_frame",
    "parse_server_frame",
]
