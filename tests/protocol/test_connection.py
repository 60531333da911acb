"""The sans-I/O connection state machines, with no sockets: bytes in, frames and bytes out."""

from __future__ import annotations

import json
from typing import Any

import pytest

from protocol import (
    JSON_SUBPROTOCOL,
    MSGPACK_SUBPROTOCOL,
    Accepted,
    Cancel,
    Chat,
    ClientFrame,
    CloseCode,
    Delta,
    Done,
    Error,
    ErrorCode,
    Hello,
    Message,
    Params,
    Ping,
    Pong,
    ProtocolError,
    Resume,
    ResumePoint,
    ServerFrame,
    Usage,
    Welcome,
    parse_client_frame,
    parse_server_frame,
)
from protocol.connection import (
    MAX_CONSECUTIVE_BAD_FRAMES,
    ClientConnection,
    InvalidState,
    ServerConnection,
    ServerState,
)

SUBPROTOCOLS = pytest.mark.parametrize("subprotocol", [MSGPACK_SUBPROTOCOL, JSON_SUBPROTOCOL])

WELCOME = Welcome(session="s-1", session_token="st-1", server="tokenwire-test", limits={"max_inflight": 4})
GOOD_CHAT: dict[str, Any] = {"type": "chat", "id": "r-1", "content": "hi"}
BAD_CHAT: dict[str, Any] = {"type": "chat", "id": "r-1"}  # neither content nor messages


def _send(conn: ServerConnection, obj: object) -> None:
    conn.receive_data(conn.codec.encode(obj))  # type: ignore[arg-type]


def _errors(conn: ServerConnection) -> list[Error]:
    out: list[Error] = []
    for message in conn.data_to_send():
        frame = parse_server_frame(conn.codec.decode(message))
        assert isinstance(frame, Error)
        out.append(frame)
    return out


def _open(subprotocol: str = MSGPACK_SUBPROTOCOL, *, welcome: bool = True) -> ServerConnection:
    conn = ServerConnection(subprotocol)
    _send(conn, {"type": "hello", "v": 1})
    assert conn.events_received() == [Hello()]
    assert conn.state is ServerState.OPEN
    if welcome:
        conn.send(WELCOME)
        conn.data_to_send()
    return conn


# ---- ordering ----------------------------------------------------------------------------------


@SUBPROTOCOLS
def test_chat_before_hello_is_a_bad_frame_and_the_connection_stays_open(subprotocol: str) -> None:
    conn = ServerConnection(subprotocol)
    _send(conn, GOOD_CHAT)
    [err] = _errors(conn)
    assert err.code == ErrorCode.BAD_FRAME
    assert err.id == "r-1"
    assert "hello" in err.message
    assert conn.events_received() == []
    assert conn.close_code is None
    assert conn.state is ServerState.AWAITING_HELLO

    _send(conn, {"type": "hello", "v": 1})
    _send(conn, GOOD_CHAT)
    assert conn.events_received() == [Hello(), Chat(id="r-1", content="hi")]
    assert conn.data_to_send() == []


@pytest.mark.parametrize("frame", [{"type": "ping"}, {"type": "cancel", "id": "c"}])
def test_other_frames_before_hello_are_bad_frames(frame: dict[str, Any]) -> None:
    conn = ServerConnection(JSON_SUBPROTOCOL)
    _send(conn, frame)
    [err] = _errors(conn)
    assert err.code == ErrorCode.BAD_FRAME
    assert err.id == frame.get("id")
    assert conn.events_received() == []
    assert conn.close_code is None


@SUBPROTOCOLS
def test_second_hello_is_a_bad_frame(subprotocol: str) -> None:
    conn = _open(subprotocol)
    _send(conn, {"type": "hello", "v": 1, "session_token": "other"})
    [err] = _errors(conn)
    assert err.code == ErrorCode.BAD_FRAME
    assert err.id is None
    assert conn.events_received() == []
    assert conn.close_code is None
    assert conn.state is ServerState.OPEN
    _send(conn, GOOD_CHAT)
    assert conn.events_received() == [Chat(id="r-1", content="hi")]


def test_hello_with_resume_points_becomes_the_event() -> None:
    conn = ServerConnection(MSGPACK_SUBPROTOCOL)
    _send(conn, {"type": "hello", "v": 1, "token": "jwt", "resume": [{"id": "a", "offset": 3}]})
    assert conn.events_received() == [Hello(token="jwt", resume=(ResumePoint("a", 3),))]


@pytest.mark.parametrize("version", [2**64, -(2**63) - 1, 10**30])
def test_a_version_beyond_the_wires_integers_is_a_bad_frame(version: int) -> None:
    # SPEC §3: an integer outside -2^63 .. 2^64-1 (JSON can spell one) is a bad frame, whatever the field.
    conn = ServerConnection(JSON_SUBPROTOCOL)
    conn.receive_data(json.dumps({"type": "hello", "v": version}).encode())
    [err] = _errors(conn)
    assert err.code == ErrorCode.BAD_FRAME and conn.close_code is None
    _send(conn, {"type": "hello", "v": 1})
    assert conn.events_received() != []  # the connection went on: the next hello is read


@pytest.mark.parametrize(
    "frame",
    [
        {"type": "resume", "id": "r-1", "offset": 2**64},
        {"type": "resume", "id": "r-1", "offset": 10**30},
        {"type": "hello", "v": 1, "resume": [{"id": "r-1", "offset": 2**64}]},
    ],
)
def test_a_resume_offset_beyond_the_wires_integers_is_a_bad_frame(frame: dict[str, Any]) -> None:
    # SPEC §3 and §4.1: a JSON offset past 2^64-1 is refused as a field, before any store is asked (it was
    # taken, then answered not_found or "past the tokens generated so far").
    with pytest.raises(ProtocolError) as err:
        parse_client_frame(frame)
    assert err.value.code == ErrorCode.BAD_FRAME and "offset" in str(err.value)
    assert parse_client_frame({"type": "resume", "id": "r-1", "offset": 2**64 - 1}) == Resume(
        id="r-1", offset=2**64 - 1
    )


@SUBPROTOCOLS
@pytest.mark.parametrize("version", [0, 2, 99])
def test_unsupported_version_closes_with_1002(subprotocol: str, version: int) -> None:
    conn = ServerConnection(subprotocol)
    _send(conn, {"type": "hello", "v": version})
    [err] = _errors(conn)
    assert err.code == ErrorCode.UNSUPPORTED_VERSION
    assert conn.close_code is CloseCode.PROTOCOL_ERROR
    assert int(CloseCode.PROTOCOL_ERROR) == 1002
    assert conn.state is ServerState.CLOSING
    assert len(conn.close_reason.encode()) <= 123
    assert conn.events_received() == []
    # Anything after that is dropped.
    _send(conn, {"type": "hello", "v": 1})
    assert conn.events_received() == []
    assert conn.data_to_send() == []


# ---- bad-frame budget --------------------------------------------------------------------------


@SUBPROTOCOLS
def test_sixteen_bad_frames_in_a_row_close_with_1008(subprotocol: str) -> None:
    assert MAX_CONSECUTIVE_BAD_FRAMES == 16
    conn = _open(subprotocol)
    for i in range(MAX_CONSECUTIVE_BAD_FRAMES - 1):
        _send(conn, BAD_CHAT)
        assert conn.close_code is None, i
    _send(conn, BAD_CHAT)
    assert conn.close_code is CloseCode.POLICY_VIOLATION
    assert int(CloseCode.POLICY_VIOLATION) == 1008
    assert conn.state is ServerState.CLOSING
    errors = _errors(conn)
    assert len(errors) == MAX_CONSECUTIVE_BAD_FRAMES  # the last bad frame is still answered
    assert all(e.code == ErrorCode.BAD_FRAME and e.id == "r-1" for e in errors)
    _send(conn, GOOD_CHAT)
    assert conn.events_received() == []
    assert conn.data_to_send() == []


def test_undecodable_messages_count_as_bad_frames() -> None:
    conn = _open(MSGPACK_SUBPROTOCOL)
    for _ in range(MAX_CONSECUTIVE_BAD_FRAMES):
        conn.receive_data(b"\xc1")
    assert conn.close_code is CloseCode.POLICY_VIOLATION


@pytest.mark.parametrize(
    "raw",
    [
        # {"type": "chat", "id": "m1", "id": "m2", "content": "x"}: msgpack spells what a dict cannot
        b"\x84\xa4type\xa4chat\xa2id\xa2m1\xa2id\xa2m2\xa7content\xa1x",
        b"\x82\xa4type\xa4chat\xa4type\xa4ping",  # {"type": "chat", "type": "ping"}
    ],
)
def test_a_msgpack_map_that_repeats_a_key_is_a_bad_frame(raw: bytes) -> None:
    # SPEC §2.1: one schema, both encodings. Before, JSON refused a repeated key and msgpack took the last
    # value, so a proxy that reads the first could be shown one frame and the server act on another.
    conn = _open(MSGPACK_SUBPROTOCOL)
    conn.receive_data(raw)
    assert conn.events_received() == []
    (err,) = _errors(conn)
    assert err.code == ErrorCode.BAD_FRAME and "repeats a key" in err.message


def test_bad_frames_before_hello_count_too() -> None:
    conn = ServerConnection(MSGPACK_SUBPROTOCOL)
    for _ in range(MAX_CONSECUTIVE_BAD_FRAMES):
        _send(conn, GOOD_CHAT)  # valid, but out of order
    assert conn.close_code is CloseCode.POLICY_VIOLATION
    assert len(_errors(conn)) == MAX_CONSECUTIVE_BAD_FRAMES


@SUBPROTOCOLS
def test_a_good_frame_resets_the_bad_frame_counter(subprotocol: str) -> None:
    conn = _open(subprotocol)
    for _ in range(3):
        for _ in range(MAX_CONSECUTIVE_BAD_FRAMES - 1):
            _send(conn, BAD_CHAT)
        _send(conn, GOOD_CHAT)
        assert conn.close_code is None
        assert conn.events_received() == [Chat(id="r-1", content="hi")]
    assert len(_errors(conn)) == 3 * (MAX_CONSECUTIVE_BAD_FRAMES - 1)
    _send(conn, BAD_CHAT)
    assert conn.close_code is None


def test_max_bad_frames_is_configurable() -> None:
    conn = ServerConnection(JSON_SUBPROTOCOL, max_bad_frames=1)
    conn.receive_data("not json")
    assert conn.close_code is CloseCode.POLICY_VIOLATION
    assert [e.code for e in _errors(conn)] == [ErrorCode.BAD_FRAME]


# ---- output ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "frame",
    [
        Delta(id="r-1", offset=0, n=1, text="x"),
        Accepted(id="r-1", epoch=1, state="queued"),
        Done(id="r-1", finish_reason="stop", offset=1, usage=Usage(1, 1)),
        Pong(),
    ],
    ids=lambda f: f.type,
)
def test_sending_before_welcome_raises(frame: ServerFrame) -> None:
    conn = ServerConnection(MSGPACK_SUBPROTOCOL)
    with pytest.raises(InvalidState):
        conn.send(frame)
    conn = _open(welcome=False)
    with pytest.raises(InvalidState):
        conn.send(frame)
    assert conn.data_to_send() == []


def test_welcome_before_hello_raises() -> None:
    conn = ServerConnection(MSGPACK_SUBPROTOCOL)
    with pytest.raises(InvalidState):
        conn.send(WELCOME)
    assert conn.data_to_send() == []


def test_welcome_twice_raises() -> None:
    conn = _open(welcome=False)
    conn.send(WELCOME)
    with pytest.raises(InvalidState):
        conn.send(WELCOME)
    assert len(conn.data_to_send()) == 1


def test_errors_may_be_sent_before_welcome() -> None:
    conn = _open(welcome=False)
    conn.send(Error(code=ErrorCode.OVERLOADED, message="busy", retry_after_ms=100))
    [err] = _errors(conn)
    assert err == Error(code="overloaded", message="busy", retry_after_ms=100)


@SUBPROTOCOLS
def test_server_output_is_in_order_and_typed(subprotocol: str) -> None:
    conn = _open(subprotocol, welcome=False)
    frames: list[ServerFrame] = [
        WELCOME,
        Accepted(id="r-1", epoch=1, state="queued"),
        Delta(id="r-1", offset=0, n=2, text="héllo"),
        Done(id="r-1", finish_reason="length", offset=2, usage=Usage(3, 2)),
        Pong(ts=5),
    ]
    for f in frames:
        conn.send(f)
    out = conn.data_to_send()
    assert all(isinstance(m, bytes if subprotocol == MSGPACK_SUBPROTOCOL else str) for m in out)
    assert [parse_server_frame(conn.codec.decode(m)) for m in out] == frames
    assert conn.data_to_send() == []


def test_after_close_there_is_no_more_output() -> None:
    conn = _open()
    conn.send(Delta(id="r-1", offset=0, n=1, text="a"))
    conn.close(CloseCode.SERVICE_RESTART, "draining")
    assert conn.state is ServerState.CLOSING
    assert conn.close_code is CloseCode.SERVICE_RESTART
    # What was queued before close is still flushed...
    assert len(conn.data_to_send()) == 1
    # ...but nothing is queued after it, and input is ignored.
    conn.send(Delta(id="r-1", offset=1, n=1, text="b"))
    conn.send(WELCOME)  # no InvalidState either: a closing connection drops everything
    conn.send_error(ProtocolError(ErrorCode.INTERNAL, "late"))
    _send(conn, GOOD_CHAT)
    conn.receive_data(b"\xc1")
    assert conn.data_to_send() == []
    assert conn.events_received() == []
    # The first close wins.
    conn.close(CloseCode.NORMAL)
    assert conn.close_code is CloseCode.SERVICE_RESTART
    assert conn.close_reason == "draining"


def test_fail_sends_the_error_then_closes() -> None:
    conn = ServerConnection(JSON_SUBPROTOCOL)
    _send(conn, {"type": "hello", "v": 1, "token": "bad"})
    conn.events_received()
    conn.fail(ProtocolError(ErrorCode.UNAUTHORIZED, "invalid token"), CloseCode.POLICY_VIOLATION)
    [err] = _errors(conn)
    assert err.code == ErrorCode.UNAUTHORIZED
    assert err.message == "invalid token"
    assert conn.close_code is CloseCode.POLICY_VIOLATION
    assert conn.close_reason == "invalid token"


def test_close_reason_is_truncated_to_fit_a_close_frame() -> None:
    conn = _open()
    conn.close(CloseCode.INTERNAL_ERROR, "x" * 500)
    assert len(conn.close_reason.encode()) <= 123


def test_unknown_subprotocol_is_refused() -> None:
    with pytest.raises(ValueError):
        ServerConnection("tokenwire.v2.msgpack")
    with pytest.raises(ValueError):
        ClientConnection("json")


# ---- client side -------------------------------------------------------------------------------


@SUBPROTOCOLS
def test_client_server_round_trip(subprotocol: str) -> None:
    client = ClientConnection(subprotocol)
    server = ServerConnection(subprotocol)

    sent: list[ClientFrame] = [
        Hello(token="jwt", session_token="st", resume=(ResumePoint("old", 7),)),
        Chat(id="r-1", content="naïve café 東京 🚀"),
        Chat(
            id="r-2",
            messages=(Message("system", "be brief"), Message("user", "hi")),
            params=Params(max_tokens=8, temperature=0.5, top_p=0.9, top_k=5, seed=1, stop=("\n",)),
        ),
        Resume(id="r-1", offset=3),
        Cancel(id="r-2"),
        Ping(ts=12.5),
    ]
    for f in sent:
        client.send(f)
    for message in client.data_to_send():
        server.receive_data(message)
    assert server.events_received() == sent
    assert server.data_to_send() == []

    replies: list[ServerFrame] = [
        WELCOME,
        Accepted(id="r-1", epoch=2, state="running"),
        Delta(id="r-1", offset=0, n=3, text="東京"),
        Done(id="r-1", finish_reason="stop", offset=3, usage=Usage(10, 3)),
        Error(code="not_found", message="gone", id="r-9"),
        Pong(ts=12.5),
    ]
    for r in replies:
        server.send(r)
    for message in server.data_to_send():
        client.receive_data(message)
    assert client.events_received() == replies
    assert client.events_received() == []


def test_client_send_raw_reaches_the_server_as_a_bad_frame() -> None:
    client = ClientConnection(JSON_SUBPROTOCOL)
    server = ServerConnection(JSON_SUBPROTOCOL)
    client.send_raw(["not", "a", "map"])
    [message] = client.data_to_send()
    server.receive_data(message)
    [err] = _errors(server)
    assert err.code == ErrorCode.BAD_FRAME


@pytest.mark.parametrize(
    "raw",
    [
        {"type": "delta", "id": "r", "offset": -1, "n": 1, "text": "x"},
        {"type": "done", "id": "r", "finish_reason": "tired", "offset": 1, "usage": {}},
        {"type": "welcome", "v": 1, "session": "s"},
        {"type": "chat", "id": "r", "content": "x"},
        [1, 2],
    ],
)
def test_client_rejects_invalid_server_frames(raw: object) -> None:
    client = ClientConnection(MSGPACK_SUBPROTOCOL)
    with pytest.raises(ProtocolError) as info:
        client.receive_data(client.codec.encode(raw))  # type: ignore[arg-type]
    assert info.value.code is ErrorCode.BAD_FRAME
    assert client.events_received() == []


def test_client_rejects_undecodable_messages() -> None:
    client = ClientConnection(JSON_SUBPROTOCOL)
    with pytest.raises(ProtocolError):
        client.receive_data(b'{"type":"pong"}')
    with pytest.raises(ProtocolError):
        client.receive_data("{")


# ---- canonical payload -------------------------------------------------------------------------


def _chat(**fields: Any) -> Chat:
    frame = parse_client_frame({"type": "chat", "id": "r-1", **fields})
    assert isinstance(frame, Chat)
    return frame


def test_canonical_is_equal_for_temperature_1_and_1_0() -> None:
    a = _chat(content="hi", params={"temperature": 1})
    b = _chat(content="hi", params={"temperature": 1.0})
    assert a.canonical() == b.canonical()


def test_canonical_is_equal_across_codecs() -> None:
    wire = {"type": "chat", "id": "r-1", "content": "hi", "params": {"temperature": 1, "top_p": 1}}
    canon = set()
    for subprotocol in (MSGPACK_SUBPROTOCOL, JSON_SUBPROTOCOL):
        conn = _open(subprotocol)
        _send(conn, wire)
        [frame] = conn.events_received()
        assert isinstance(frame, Chat)
        canon.add(frame.canonical())
    assert len(canon) == 1


def test_canonical_ignores_id_key_order_and_stop_spelling() -> None:
    a = _chat(content="hi", params={"max_tokens": 5, "stop": "\n", "seed": 3})
    b = parse_client_frame(
        {
            "params": {"seed": 3, "stop": ["\n"], "max_tokens": 5},
            "content": "hi",
            "id": "other",
            "type": "chat",
        }
    )
    assert isinstance(b, Chat)
    assert a.canonical() == b.canonical()
    assert "r-1" not in a.canonical()


def test_canonical_ignores_unknown_keys() -> None:
    assert _chat(content="hi").canonical() == _chat(content="hi", extension={"x": 1}).canonical()


@pytest.mark.parametrize(
    "other",
    [
        {"content": "hi!"},
        {"content": "Hi"},
        {"messages": [{"role": "user", "content": "hi"}]},
        {"content": "hi", "params": {"temperature": 0.9}},
        {"content": "hi", "params": {"max_tokens": 1}},
        {"content": "hi", "params": {"seed": 0}},
        {"content": "hi", "params": {"stop": ["x"]}},
    ],
)
def test_canonical_differs_for_different_payloads(other: dict[str, Any]) -> None:
    assert _chat(content="hi").canonical() != _chat(**other).canonical()


def test_canonical_is_valid_json_with_unicode() -> None:
    c = _chat(content="naïve café 東京 🚀")
    assert json.loads(c.canonical()) == {"content": "naïve café 東京 🚀"}
    assert "東京" in c.canonical()


@pytest.mark.parametrize(
    ("subprotocol", "raw", "says"),
    [
        # Python's own text named a Python setting (sys.set_int_max_str_digits), of no use to a client.
        (JSON_SUBPROTOCOL, '{"type":"ping","ts":' + "9" * 5000 + "}", "an integer of more than 4300 digits"),
        # A msgpack extension value is a namedtuple: it was called an array.
        (MSGPACK_SUBPROTOCOL, b"\x82\xa4type\xa4ping\xa2ts\xd4\x01\x00", "got msgpack extension type"),
    ],
)
def test_bad_values_are_named_in_the_protocols_words(subprotocol: str, raw: str | bytes, says: str) -> None:
    conn = _open(subprotocol)
    conn.receive_data(raw)
    (err,) = _errors(conn)
    assert err.code == ErrorCode.BAD_FRAME and says in err.message, err.message
