"""The golden vectors in protocol/vectors/frames.json against the codecs, the parsers and ServerConnection."""

from __future__ import annotations

import json
from typing import Any

import pytest

from protocol import (
    JSON_SUBPROTOCOL,
    MSGPACK_SUBPROTOCOL,
    Chat,
    ClientFrame,
    CloseCode,
    Done,
    Error,
    ErrorCode,
    Hello,
    ProtocolError,
    ServerFrame,
    Usage,
    codec_for,
    parse_client_frame,
    parse_server_frame,
)
from protocol.connection import ServerConnection, ServerState
from protocol.vectors import generate

VECTORS: dict[str, Any] = json.loads(generate.PATH.read_text(encoding="utf-8"))
VALID: list[dict[str, Any]] = VECTORS["valid"]
INVALID: list[dict[str, Any]] = VECTORS["invalid"]

HELLO: dict[str, Any] = {"type": "hello", "v": 1}
CHAT: dict[str, Any] = {"type": "chat", "id": "after-error", "content": "still here?"}


def _parse(vector: dict[str, Any], raw: object) -> ClientFrame | ServerFrame:
    if vector["direction"] == "client":
        return parse_client_frame(raw)
    return parse_server_frame(raw)


def _data(vector: dict[str, Any]) -> bytes | str:
    if "data_hex" in vector:
        assert "data_text" not in vector
        return bytes.fromhex(vector["data_hex"])
    text = vector["data_text"]
    assert isinstance(text, str)
    return text


# ---- the file itself ---------------------------------------------------------------------------


def test_committed_vectors_match_generator() -> None:
    assert generate.PATH.read_text(encoding="utf-8") == generate.render(), (
        "protocol/vectors/frames.json is stale: run python -m protocol.vectors.generate and commit it"
    )


def test_generator_check_mode_agrees() -> None:
    assert generate.main(["--check"]) == 0


def test_vector_file_shape() -> None:
    assert VECTORS["version"] == 1
    assert set(VECTORS) == {"version", "valid", "invalid"}
    names = [v["name"] for v in VALID + INVALID]
    assert len(names) == len(set(names))
    assert len(INVALID) >= 25
    for v in VALID:
        assert set(v) == {"name", "direction", "frame", "json", "msgpack_hex"}
        assert v["direction"] in ("client", "server")
    for v in INVALID:
        assert set(v) - {"data_hex", "data_text"} == {"name", "subprotocol", "expected_code", "expect_id"}
        assert ("data_hex" in v) != ("data_text" in v)
        assert v["subprotocol"] in (MSGPACK_SUBPROTOCOL, JSON_SUBPROTOCOL)
        assert v["expected_code"] in (ErrorCode.BAD_FRAME, ErrorCode.UNSUPPORTED_VERSION)


def test_every_frame_type_is_covered() -> None:
    client = {v["frame"]["type"] for v in VALID if v["direction"] == "client"}
    server = {v["frame"]["type"] for v in VALID if v["direction"] == "server"}
    assert client == {"hello", "chat", "resume", "cancel", "ping"}
    assert server == {"welcome", "accepted", "waiting", "delta", "done", "error", "pong"}
    reasons = {v["frame"]["finish_reason"] for v in VALID if v["frame"]["type"] == "done"}
    assert reasons == {"stop", "length", "cancelled", "error"}
    frames = [v["frame"] for v in VALID]
    assert any(f["type"] == "hello" and f.get("resume") for f in frames)
    assert any(f["type"] == "chat" and "messages" in f for f in frames)
    assert any(f["type"] == "chat" and len(f.get("params", {})) == 6 for f in frames)
    assert any(f["type"] == "error" and "retry_after_ms" in f for f in frames)
    assert any(generate.UNICODE in json.dumps(f, ensure_ascii=False) for f in frames)


# ---- valid vectors -----------------------------------------------------------------------------


@pytest.mark.parametrize("vector", VALID, ids=[v["name"] for v in VALID])
def test_valid_vector_round_trips(vector: dict[str, Any]) -> None:
    json_codec = codec_for(JSON_SUBPROTOCOL)
    msgpack_codec = codec_for(MSGPACK_SUBPROTOCOL)
    text: str = vector["json"]
    data = bytes.fromhex(vector["msgpack_hex"])

    from_frame = _parse(vector, vector["frame"])
    from_json = _parse(vector, json_codec.decode(text))
    from_msgpack = _parse(vector, msgpack_codec.decode(data))
    assert from_json == from_frame
    assert from_msgpack == from_frame
    assert json.loads(text) == vector["frame"]

    wire = from_frame.to_wire()
    assert wire == vector["frame"]
    # Byte-exact: what the codecs emit for the parsed frame is what the vector stores.
    assert json_codec.encode(from_json.to_wire()) == text
    assert msgpack_codec.encode(from_msgpack.to_wire()) == data
    # And across: a frame read from one encoding re-encodes exactly into the other.
    assert msgpack_codec.encode(from_json.to_wire()) == data
    assert json_codec.encode(from_msgpack.to_wire()) == text


@pytest.mark.parametrize("subprotocol", [MSGPACK_SUBPROTOCOL, JSON_SUBPROTOCOL])
@pytest.mark.parametrize(
    "vector",
    [v for v in VALID if v["direction"] == "client"],
    ids=[v["name"] for v in VALID if v["direction"] == "client"],
)
def test_valid_client_vector_is_an_event(vector: dict[str, Any], subprotocol: str) -> None:
    conn = ServerConnection(subprotocol)
    message = bytes.fromhex(vector["msgpack_hex"]) if subprotocol == MSGPACK_SUBPROTOCOL else vector["json"]
    expected = parse_client_frame(vector["frame"])
    if not isinstance(expected, Hello):
        conn.receive_data(conn.codec.encode(HELLO))
        assert isinstance(conn.events_received()[0], Hello)
    conn.receive_data(message)
    assert conn.data_to_send() == []
    assert conn.events_received() == [expected]
    assert conn.close_code is None


# ---- invalid vectors ---------------------------------------------------------------------------


def _expect_error(conn: ServerConnection, vector: dict[str, Any]) -> None:
    out = conn.data_to_send()
    assert len(out) == 1, out
    assert isinstance(out[0], bytes) == conn.codec.binary
    err = parse_server_frame(conn.codec.decode(out[0]))
    assert isinstance(err, Error)
    assert err.code == vector["expected_code"]
    assert err.id == vector["expect_id"]
    assert err.retry_after_ms is None
    assert err.message
    assert conn.events_received() == []


def _expect_still_usable(conn: ServerConnection, vector: dict[str, Any]) -> None:
    chat = conn.codec.encode(CHAT)
    if vector["expected_code"] == ErrorCode.UNSUPPORTED_VERSION:
        # The one invalid frame that ends the connection: the peer speaks another protocol.
        assert conn.close_code is CloseCode.PROTOCOL_ERROR
        assert conn.state is ServerState.CLOSING
        conn.receive_data(chat)
        assert conn.events_received() == []
        assert conn.data_to_send() == []
        return
    assert conn.close_code is None
    if conn.state is ServerState.AWAITING_HELLO:
        conn.receive_data(conn.codec.encode(HELLO))
        assert isinstance(conn.events_received()[0], Hello)
    conn.receive_data(chat)
    assert conn.data_to_send() == []
    assert conn.events_received() == [Chat(id="after-error", content="still here?")]
    assert conn.close_code is None


@pytest.mark.parametrize("vector", INVALID, ids=[v["name"] for v in INVALID])
def test_invalid_vector_after_hello(vector: dict[str, Any]) -> None:
    conn = ServerConnection(vector["subprotocol"])
    conn.receive_data(conn.codec.encode(HELLO))
    assert isinstance(conn.events_received()[0], Hello)
    conn.receive_data(_data(vector))
    _expect_error(conn, vector)
    _expect_still_usable(conn, vector)


@pytest.mark.parametrize("vector", INVALID, ids=[v["name"] for v in INVALID])
def test_invalid_vector_as_first_frame(vector: dict[str, Any]) -> None:
    # Validation comes before ordering, so the answer is the same whether or not hello came first.
    conn = ServerConnection(vector["subprotocol"])
    conn.receive_data(_data(vector))
    _expect_error(conn, vector)
    _expect_still_usable(conn, vector)


@pytest.mark.parametrize("vector", INVALID, ids=[v["name"] for v in INVALID])
def test_invalid_vector_is_refused_by_the_parser(vector: dict[str, Any]) -> None:
    codec = codec_for(vector["subprotocol"])
    with pytest.raises(ProtocolError) as info:
        parse_client_frame(codec.decode(_data(vector)))
    assert info.value.code == vector["expected_code"]
    assert info.value.id == vector["expect_id"]


def test_done_without_cached_tokens_reads_as_zero() -> None:
    """A server before cached_tokens sends usage without it (SPEC §4: a receiver reads 0); a present one
    must be a non-negative integer like the other counts."""
    done = {"type": "done", "id": "r", "finish_reason": "stop", "offset": 2}
    frame = parse_server_frame({**done, "usage": {"prompt_tokens": 5, "completion_tokens": 2}})
    assert isinstance(frame, Done) and frame.usage == Usage(5, 2, 0)
    for bad in (-1, "3", 1.5, None, True, 6):  # 6: more than the prompt's 5
        with pytest.raises(ProtocolError, match=r"done\.usage\.cached_tokens"):
            parse_server_frame(
                {**done, "usage": {"prompt_tokens": 5, "completion_tokens": 2, "cached_tokens": bad}}
            )


def test_done_cancel_reason_is_a_cancelled_requests_only() -> None:
    """done.cancel_reason (SPEC §10.5): present only with finish_reason cancelled, a string a receiver
    need not know (any value is still a cancel); on another finish, or not a string, the frame is bad."""
    done = {"type": "done", "id": "r", "offset": 2, "usage": {"prompt_tokens": 5, "completion_tokens": 2}}
    for why in ("detach_timeout", "something_newer"):
        frame = parse_server_frame({**done, "finish_reason": "cancelled", "cancel_reason": why})
        assert isinstance(frame, Done) and frame.cancel_reason == why
        assert frame.to_wire()["cancel_reason"] == why
    plain = parse_server_frame({**done, "finish_reason": "cancelled"})
    assert isinstance(plain, Done) and plain.cancel_reason is None and "cancel_reason" not in plain.to_wire()
    with pytest.raises(ProtocolError, match=r"done\.cancel_reason"):
        parse_server_frame({**done, "finish_reason": "stop", "cancel_reason": "detach_timeout"})
    with pytest.raises(ProtocolError, match=r"done\.cancel_reason"):
        parse_server_frame({**done, "finish_reason": "cancelled", "cancel_reason": 1})


def test_done_length_reason_is_a_length_requests_only() -> None:
    """done.length_reason (SPEC §12): which limit ended a length, present only with finish_reason length,
    a string a receiver need not know; on another finish, or not a string, the frame is bad."""
    done = {"type": "done", "id": "r", "offset": 2, "usage": {"prompt_tokens": 5, "completion_tokens": 2}}
    for why in ("max_tokens", "context", "something_newer"):
        frame = parse_server_frame({**done, "finish_reason": "length", "length_reason": why})
        assert isinstance(frame, Done) and frame.length_reason == why
        assert frame.to_wire()["length_reason"] == why
    plain = parse_server_frame({**done, "finish_reason": "length"})
    assert isinstance(plain, Done) and plain.length_reason is None and "length_reason" not in plain.to_wire()
    with pytest.raises(ProtocolError, match=r"done\.length_reason"):
        parse_server_frame({**done, "finish_reason": "stop", "length_reason": "context"})
    with pytest.raises(ProtocolError, match=r"done\.length_reason"):
        parse_server_frame({**done, "finish_reason": "length", "length_reason": ["context"]})
