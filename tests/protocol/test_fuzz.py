"""Hostile input never crashes ServerConnection: whatever arrives, the answer is an error frame or an event.

The tests at the end pin bugs found by this fuzzing (huge integers, deep nesting, lone surrogates).
"""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from protocol import (
    JSON_SUBPROTOCOL,
    MSGPACK_SUBPROTOCOL,
    Chat,
    CloseCode,
    Error,
    ErrorCode,
    parse_client_frame,
    parse_server_frame,
)
from protocol.connection import ServerConnection, ServerState

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SUBPROTOCOLS = pytest.mark.parametrize("subprotocol", [MSGPACK_SUBPROTOCOL, JSON_SUBPROTOCOL])
ERROR_CODES = {c.value for c in ErrorCode}
HELLO: dict[str, Any] = {"type": "hello", "v": 1}

# ---- strategies --------------------------------------------------------------------------------

_INT64 = st.integers(min_value=-(2**63), max_value=2**64 - 1)  # what msgpack can carry
_SCALARS = st.none() | st.booleans() | _INT64 | st.floats() | st.text(max_size=80)
_KEYS = st.sampled_from(
    ["type", "id", "v", "content", "messages", "role", "params", "offset", "resume", "ts", "token", "stop"]
) | st.text(max_size=8)

# Anything msgpack can encode, keys included (ints and bytes as keys too).
msgpack_objects = st.recursive(
    _SCALARS | st.binary(max_size=40),
    lambda kids: (
        st.lists(kids, max_size=5)
        | st.dictionaries(_KEYS | st.integers(-5, 5) | st.binary(max_size=4), kids, max_size=5)
    ),
    max_leaves=30,
)

# Anything JSON can encode.
json_objects = st.recursive(
    st.none()
    | st.booleans()
    | _INT64
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=80),
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(_KEYS, kids, max_size=5),
    max_leaves=30,
)

_TYPES = st.sampled_from(["hello", "chat", "resume", "cancel", "ping", "welcome", "delta", "Chat", ""])
_IDS = st.sampled_from(["r-1", "", "x" * 64, "x" * 65, "a\x00b", "é東🚀"]) | _SCALARS
_PARAM_VALUES = st.sampled_from([0, 1, -1, 0.5, 1.0, 2.0, 3, 8192, 8193, True, "1", None]) | _SCALARS


@st.composite
def frame_like(draw: st.DrawFn, values: st.SearchStrategy[Any]) -> dict[str, Any]:
    """A map shaped like a client frame, with each field present, absent, right or wrong."""
    frame: dict[str, Any] = {"type": draw(_TYPES)}
    optional = {
        "id": _IDS,
        "v": st.sampled_from([1, 2, 0, "1", 1.0, True]),
        "content": st.text(max_size=20) | values,
        "messages": st.lists(
            st.fixed_dictionaries(
                {}, optional={"role": st.sampled_from(["system", "user", "assistant", "bot"]) | values}
            ).map(lambda m: {**m, "content": "c"})
            | values,
            max_size=3,
        )
        | values,
        "params": st.dictionaries(
            st.sampled_from(["max_tokens", "temperature", "top_p", "top_k", "seed", "stop"]),
            _PARAM_VALUES | st.lists(st.text(max_size=70), max_size=6),
            max_size=6,
        )
        | values,
        "offset": st.integers(-3, 3) | values,
        "ts": values,
        "token": st.text(max_size=10) | values,
        "resume": st.lists(
            st.fixed_dictionaries({"id": _IDS, "offset": st.integers(-1, 5) | values}), max_size=3
        )
        | values,
    }
    for key, strategy in optional.items():
        if draw(st.booleans()):
            frame[key] = draw(strategy)
    return frame


# ---- checks ------------------------------------------------------------------------------------


def _check_outputs(conn: ServerConnection) -> list[Error]:
    """Every message the server queued is one valid, well-encoded error frame."""
    errors: list[Error] = []
    for message in conn.data_to_send():
        if conn.codec.binary:
            assert isinstance(message, bytes)
        else:
            assert isinstance(message, str)
            message.encode("utf-8")  # a WebSocket text message must be valid UTF-8
        frame = parse_server_frame(conn.codec.decode(message))
        assert isinstance(frame, Error), frame
        assert frame.code in ERROR_CODES
        assert frame.message
        assert len(frame.message) <= 240
        errors.append(frame)
    return errors


def _check_events(conn: ServerConnection) -> int:
    events = conn.events_received()
    for frame in events:
        # Whatever was accepted is normalised: it survives its own wire form unchanged.
        assert parse_client_frame(frame.to_wire()) == frame
        assert parse_client_frame(conn.codec.decode(conn.codec.encode(frame.to_wire()))) == frame
        if isinstance(frame, Chat):
            assert json.loads(frame.canonical())
    return len(events)


def _feed(subprotocol: str, message: bytes | str, *, after_hello: bool) -> ServerConnection:
    conn = ServerConnection(subprotocol)
    if after_hello:
        conn.receive_data(conn.codec.encode(HELLO))
        conn.events_received()
    conn.receive_data(message)
    errors = _check_outputs(conn)
    accepted = _check_events(conn)
    assert len(errors) + accepted == 1
    if currently_in_test_context():
        event(f"error {errors[0].code}" if errors else "accepted")
    if conn.close_code is not None:
        assert conn.close_code is CloseCode.PROTOCOL_ERROR
        assert [e.code for e in errors] == [ErrorCode.UNSUPPORTED_VERSION]
    return conn


# ---- fuzz --------------------------------------------------------------------------------------


@SUBPROTOCOLS
@FUZZ
@given(data=st.binary(max_size=200), after_hello=st.booleans())
def test_random_bytes(subprotocol: str, data: bytes, after_hello: bool) -> None:
    _feed(subprotocol, data, after_hello=after_hello)


@SUBPROTOCOLS
@FUZZ
@given(obj=msgpack_objects, after_hello=st.booleans())
def test_random_msgpack_objects(subprotocol: str, obj: object, after_hello: bool) -> None:
    _feed(subprotocol, msgpack.packb(obj, use_bin_type=True), after_hello=after_hello)


@FUZZ
@given(obj=json_objects, after_hello=st.booleans(), ascii_only=st.booleans())
def test_random_json_objects(obj: object, after_hello: bool, ascii_only: bool) -> None:
    _feed(JSON_SUBPROTOCOL, json.dumps(obj, ensure_ascii=ascii_only), after_hello=after_hello)


@SUBPROTOCOLS
@FUZZ
@given(text=st.text(max_size=200), after_hello=st.booleans())
def test_random_text(subprotocol: str, text: str, after_hello: bool) -> None:
    _feed(subprotocol, text, after_hello=after_hello)


@FUZZ
@given(frame=frame_like(msgpack_objects), after_hello=st.booleans())
def test_frame_shaped_msgpack_maps(frame: dict[str, Any], after_hello: bool) -> None:
    _feed(MSGPACK_SUBPROTOCOL, msgpack.packb(frame, use_bin_type=True), after_hello=after_hello)


@FUZZ
@given(frame=frame_like(json_objects), after_hello=st.booleans())
def test_frame_shaped_json_maps(frame: dict[str, Any], after_hello: bool) -> None:
    # json.dumps writes NaN and Infinity for non-finite floats; the codec must refuse those too.
    _feed(JSON_SUBPROTOCOL, json.dumps(frame, ensure_ascii=False), after_hello=after_hello)


@SUBPROTOCOLS
@settings(FUZZ, max_examples=100)
@given(
    messages=st.lists(
        frame_like(json_objects) | st.sampled_from([HELLO, {"type": "chat", "id": "ok", "content": "hi"}]),
        max_size=30,
    )
)
def test_message_sequences(subprotocol: str, messages: list[dict[str, Any]]) -> None:
    """A whole conversation of good and bad frames: the connection obeys its own rules throughout."""
    conn = ServerConnection(subprotocol)
    bad_in_a_row = 0
    for m in messages:
        was_closing = conn.state is ServerState.CLOSING
        conn.receive_data(conn.codec.encode(m))
        errors = _check_outputs(conn)
        events = conn.events_received()
        if was_closing:
            assert errors == [] and events == []
            continue
        assert len(errors) + len(events) == 1
        bad_in_a_row = bad_in_a_row + 1 if errors else 0
        if errors and errors[0].code == ErrorCode.UNSUPPORTED_VERSION:
            assert conn.close_code is CloseCode.PROTOCOL_ERROR
        elif bad_in_a_row >= 16:
            assert conn.close_code is CloseCode.POLICY_VIOLATION
        else:
            assert conn.close_code is None


# ---- regressions found by fuzzing -----------------------------------------------------

_HUGE = "1" + "0" * 400  # a JSON integer no float can hold


@pytest.mark.parametrize(
    "text",
    [
        '{"type":"ping","ts":' + _HUGE + "}",
        '{"type":"chat","id":"r-1","content":"hi","params":{"temperature":' + _HUGE + "}}",
        '{"type":"chat","id":"r-1","content":"hi","params":{"top_p":-' + _HUGE + "}}",
    ],
    ids=["ping_ts", "temperature", "top_p"],
)
def test_huge_json_integer_in_a_number_field_is_a_bad_frame(text: str) -> None:
    _expect_bad_frame(JSON_SUBPROTOCOL, text)


@pytest.mark.parametrize(
    "prefix",
    [
        b"\x81\xa4type",  # {"type": [[[...]]]}
        b"\x83\xa4type\xa6resume\xa2id\xa1r\xa6offset",  # {"type": "resume", "id": "r", "offset": [[[...]]]}
    ],
    ids=["type", "offset"],
)
def test_deeply_nested_msgpack_value_is_a_bad_frame(prefix: bytes) -> None:
    # msgpack itself accepts up to 1023 levels; the error message's repr() of the value does not.
    _expect_bad_frame(MSGPACK_SUBPROTOCOL, prefix + b"\x91" * 1010 + b"\xc0")


def test_lone_surrogate_in_json_id_is_not_echoed() -> None:
    # Before hello, the (readable) id is echoed in the error; "\ud800" cannot be sent in a text message.
    conn = ServerConnection(JSON_SUBPROTOCOL)
    conn.receive_data('{"type":"chat","id":"\\ud800","content":"hi"}')
    assert conn.events_received() == []
    [error] = _check_outputs(conn)
    assert error.code == ErrorCode.BAD_FRAME and error.id is None, error


def _expect_bad_frame(subprotocol: str, message: bytes | str) -> Error:
    """What the tests named "... is a bad frame" assert: one `bad_frame` error, no event, still open."""
    conn = ServerConnection(subprotocol)
    conn.receive_data(conn.codec.encode(HELLO))
    assert len(conn.events_received()) == 1
    conn.receive_data(message)
    assert conn.events_received() == []
    [error] = _check_outputs(conn)
    assert error.code == ErrorCode.BAD_FRAME, error
    assert conn.close_code is None
    return error


def test_lone_surrogate_in_json_content_is_a_bad_frame() -> None:
    # Accepted, this string breaks whatever encodes it next as UTF-8 (msgpack, Redis, the tokenizer).
    conn = ServerConnection(JSON_SUBPROTOCOL)
    conn.receive_data(conn.codec.encode(HELLO))
    conn.events_received()
    conn.receive_data('{"type":"chat","id":"r-1","content":"\\udc80"}')
    assert conn.events_received() == []
    [error] = _check_outputs(conn)
    assert error.code == ErrorCode.BAD_FRAME


# ---- volume: at least 10,000 random frames per run --------------------------------------------

FRAMES_PER_EXAMPLE = 100
VOLUME_EXAMPLES = 100  # 100 x 100 = 10,000 frames


_BASES = [
    HELLO,
    {
        "type": "chat",
        "id": "req-1",
        "content": "hello there",
        "params": {"max_tokens": 16, "temperature": 0.5},
    },
    {
        "type": "chat",
        "id": "req-2",
        "messages": [{"role": "user", "content": "hi"}],
        "params": {"stop": ["x"]},
    },
    {"type": "resume", "id": "req-1", "offset": 3, "epoch": 1},
    {"type": "cancel", "id": "req-1"},
    {"type": "ping", "ts": 1.5},
]
_MUTATION = st.tuples(
    st.integers(0, len(_BASES) - 1), st.integers(0, 4), st.integers(0, 255), st.integers(0, 255)
)


@settings(max_examples=VOLUME_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    subprotocol=st.sampled_from([MSGPACK_SUBPROTOCOL, JSON_SUBPROTOCOL]),
    mutations=st.lists(_MUTATION, min_size=FRAMES_PER_EXAMPLE, max_size=FRAMES_PER_EXAMPLE),
)
def test_ten_thousand_random_frames(subprotocol: str, mutations: list[tuple[int, int, int, int]]) -> None:
    """10,000 random messages per run (100 examples x 100): valid frames with random byte edits — kept,
    flipped, cut short, spliced, or with bytes inserted — fed to one connection after another. Never a
    crash, only documented errors, and a connection that closed is replaced by a fresh one."""
    conn = ServerConnection(subprotocol)
    for base, op, pos, byte in mutations:
        data = bytearray(_encoded(conn, base))
        i = pos % max(1, len(data))
        if op == 1:
            data[i] = byte
        elif op == 2:
            del data[i:]
        elif op == 3:
            data[i:i] = bytes([byte, byte ^ 0x5A])
        elif op == 4:
            data[i:] = data[i:][::-1]
        raw: bytes | str = bytes(data)
        if subprotocol == JSON_SUBPROTOCOL:
            raw = bytes(data).decode("utf-8", errors="replace")
        closing = conn.state is ServerState.CLOSING
        conn.receive_data(raw)
        errors = _check_outputs(conn)
        conn.events_received()
        assert not closing or errors == []
        if conn.close_code is not None:
            assert conn.close_code in (CloseCode.PROTOCOL_ERROR, CloseCode.POLICY_VIOLATION)
            conn = ServerConnection(subprotocol)


def _encoded(conn: ServerConnection, base: int) -> bytes:
    out = conn.codec.encode(_BASES[base])
    return out if isinstance(out, bytes) else out.encode()
