"""Build the golden vectors of wire protocol v1 and write them to ``protocol/vectors/frames.json``.

Run ``python -m protocol.vectors.generate`` (or this file) after a deliberate change to the wire format,
and commit the result. ``tests/protocol/test_vectors.py`` fails when the committed file differs from what
this script produces, so the vectors never drift from the code.

Valid vectors are built from the frame dataclasses; ``json`` and ``msgpack_hex`` are the exact bytes the
codecs emit for them, so any implementation (the JS client included) can check its encoder against them.
Invalid vectors are whole WebSocket messages a server must answer with an ``error`` frame of
``expected_code`` (carrying ``expect_id`` when the offending frame had a readable, valid id).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import msgpack

from protocol.codec import JSON_SUBPROTOCOL, MSGPACK_SUBPROTOCOL, codec_for
from protocol.frames import (
    FINISH_REASONS,
    MAX_ID_CHARS,
    MAX_MAX_TOKENS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOKEN_CHARS,
    REQUEST_STATES,
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

VERSION = 1
PATH = Path(__file__).with_name("frames.json")

UNICODE = "naïve café 東京 🚀"
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ1c2VyLTEifQ.c2lnbmF0dXJl"
SESSION_TOKEN = "st_5f0c2a9e7b1d4c3a8e6f"

_JSON = codec_for(JSON_SUBPROTOCOL)
_MSGPACK = codec_for(MSGPACK_SUBPROTOCOL)


# --------------------------------------------------------------------------------------------------
# valid frames


def client_frames() -> list[tuple[str, ClientFrame]]:
    all_params = Params(
        max_tokens=256,
        temperature=0.7,
        top_p=0.95,
        top_k=40,
        seed=2**63 - 1,
        stop=("\n\nUser:", "</s>"),
    )
    return [
        ("hello_minimal", Hello()),
        ("hello_token", Hello(token=JWT)),
        ("hello_session_token", Hello(session_token=SESSION_TOKEN)),
        ("hello_coalesce", Hello(coalesce_ms=100)),
        (
            "hello_resume",
            Hello(
                token=JWT,
                session_token=SESSION_TOKEN,
                resume=(ResumePoint("req-1", 0), ResumePoint("req-2", 1234, epoch=2)),
            ),
        ),
        ("chat_content", Chat(id="req-1", content="Hello!")),
        ("chat_content_unicode", Chat(id="req-ü-東京", content=UNICODE)),
        (
            "chat_messages",
            Chat(
                id="req-2",
                messages=(
                    Message("system", "You are terse."),
                    Message("user", "What is 2+2?"),
                    Message("assistant", "4"),
                    Message("user", UNICODE),
                ),
            ),
        ),
        ("chat_message_empty_content", Chat(id="req-3", messages=(Message("user", ""),))),
        ("chat_all_params", Chat(id="req-4", content="Tell me a story.", params=all_params)),
        (
            "chat_messages_all_params",
            Chat(id="req-5", messages=(Message("user", "Hi"),), params=all_params),
        ),
        (
            "chat_param_bounds",
            Chat(
                id="x" * MAX_ID_CHARS,
                content="bounds",
                params=Params(
                    max_tokens=MAX_MAX_TOKENS,
                    temperature=0.0,
                    top_p=1.0,
                    top_k=0,
                    seed=0,
                    stop=tuple("s" * MAX_STOP_CHARS for _ in range(MAX_STOP_STRINGS)),
                ),
            ),
        ),
        ("chat_one_param", Chat(id="req-6", content="Hi", params=Params(max_tokens=1))),
        ("chat_no_cache", Chat(id="req-7", content="Hi", params=Params(temperature=0.0, cache=False))),
        ("chat_temperature_2", Chat(id="req-7", content="Hi", params=Params(temperature=2.0))),
        ("chat_stop_unicode", Chat(id="req-8", content="Hi", params=Params(stop=("🚀",)))),
        ("chat_detach_timeout", Chat(id="req-9", content="Hi", params=Params(detach_timeout_ms=600_000))),
        ("resume", Resume(id="req-1", offset=42)),
        ("resume_from_zero", Resume(id="req-1", offset=0)),
        ("resume_with_epoch", Resume(id="req-1", offset=7, epoch=1)),
        ("cancel", Cancel(id="req-1")),
        ("ping", Ping()),
        ("ping_ts_int", Ping(ts=1700000000000)),
        ("ping_ts_float", Ping(ts=1700000000.25)),
    ]


def server_frames() -> list[tuple[str, ServerFrame]]:
    frames: list[tuple[str, ServerFrame]] = [
        (
            "welcome",
            Welcome(
                session="sess-7f3a",
                session_token=SESSION_TOKEN,
                server="tokenwire/0.1.0",
                limits={"max_frame_bytes": 1048576, "max_inflight": 8, "max_tokens": MAX_MAX_TOKENS},
            ),
        ),
        (
            "welcome_required_limits",
            Welcome(
                session="sess-1",
                session_token="st",
                server="tokenwire",
                limits={"max_frame_bytes": 1048576, "max_tokens": MAX_MAX_TOKENS},
            ),
        ),
    ]
    frames += [(f"accepted_{s}", Accepted(id="req-1", epoch=3, state=s)) for s in REQUEST_STATES]
    frames += [
        ("waiting", Waiting(id="req-2", after="req-1")),
        ("waiting_no_after", Waiting(id="req-2")),
    ]
    frames += [
        ("delta", Delta(id="req-1", offset=0, n=1, text="Hello")),
        ("delta_unicode", Delta(id="req-1", offset=5, n=7, text=UNICODE)),
        ("delta_empty_text", Delta(id="req-1", offset=12, n=1, text="")),
    ]
    frames += [
        (f"done_{r}", Done(id="req-1", finish_reason=r, offset=17, usage=Usage(9, 17)))
        for r in FINISH_REASONS
    ]
    frames += [
        ("done_zero_tokens", Done(id="req-2", finish_reason="stop", offset=0, usage=Usage(0, 0))),
        ("done_cached_tokens", Done(id="req-3", finish_reason="stop", offset=4, usage=Usage(31, 4, 24))),
        (
            "done_detach_timeout",
            Done(
                id="req-4",
                finish_reason="cancelled",
                offset=9,
                usage=Usage(5, 9),
                cancel_reason="detach_timeout",
            ),
        ),
        (
            "done_length_context",
            Done(id="req-5", finish_reason="length", offset=3, usage=Usage(8189, 3), length_reason="context"),
        ),
        (
            "done_length_max_tokens",
            Done(
                id="req-6", finish_reason="length", offset=16, usage=Usage(9, 16), length_reason="max_tokens"
            ),
        ),
        ("error", Error(code="bad_frame", message="content: expected a string, got number")),
        ("error_with_id", Error(code="not_found", message="no request req-9", id="req-9")),
        (
            "error_retry_after",
            Error(code="overloaded", message="server busy", id="req-1", retry_after_ms=250),
        ),
        ("error_rate_limited", Error(code="rate_limited", message="slow down", retry_after_ms=1000)),
        ("error_unicode", Error(code="internal", message=UNICODE)),
        ("pong", Pong()),
        ("pong_ts_int", Pong(ts=1700000000000)),
        ("pong_ts_float", Pong(ts=1700000000.25)),
    ]
    return frames


def _valid(name: str, direction: str, frame: ClientFrame | ServerFrame) -> dict[str, Any]:
    wire = frame.to_wire()
    text = _JSON.encode(wire)
    data = _MSGPACK.encode(wire)
    assert isinstance(text, str) and isinstance(data, bytes)
    # A vector must be a fixed point: what parses from either encoding is the frame we started from.
    parse = parse_client_frame if direction == "client" else parse_server_frame
    for decoded in (_JSON.decode(text), _MSGPACK.decode(data)):
        if parse(decoded) != frame:
            raise AssertionError(f"vector {name!r} does not round-trip: {parse(decoded)!r} != {frame!r}")
    return {"name": name, "direction": direction, "frame": wire, "json": text, "msgpack_hex": data.hex()}


# --------------------------------------------------------------------------------------------------
# invalid messages


def _mp(obj: object) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


def _chat(**fields: Any) -> dict[str, Any]:
    return {"type": "chat", "id": "req-1", "content": "Hi", **fields}


def _params(**params: Any) -> dict[str, Any]:
    return _chat(params=params)


# (name, message bytes for the msgpack subprotocol, expected code, expected id)
_MSGPACK_INVALID: list[tuple[str, bytes | str, str, str | None]] = [
    # not a frame at all
    ("not_a_map_int", _mp(42), "bad_frame", None),
    ("not_a_map_string", _mp("chat"), "bad_frame", None),
    ("not_a_map_nil", _mp(None), "bad_frame", None),
    ("array", _mp(["chat", "req-1", "Hi"]), "bad_frame", None),
    ("binary_top_level", _mp(b"\x81\xa4type"), "bad_frame", None),
    ("ext_top_level", _mp(msgpack.ExtType(5, b"\x00")), "bad_frame", None),
    ("empty_map", _mp({}), "bad_frame", None),
    ("missing_type", _mp({"id": "req-1", "content": "Hi"}), "bad_frame", None),
    ("type_null", _mp({"type": None}), "bad_frame", None),
    ("type_not_string", _mp({"type": 1}), "bad_frame", None),
    ("type_binary", _mp({"type": b"ping"}), "bad_frame", None),
    ("unknown_type", _mp({"type": "subscribe", "id": "req-1"}), "bad_frame", None),
    ("server_type_from_client", _mp({"type": "welcome", "v": 1}), "bad_frame", None),
    ("type_wrong_case", _mp({"type": "Chat", "id": "req-1", "content": "Hi"}), "bad_frame", None),
    ("non_string_map_key_int", _mp({"type": "ping", 1: "x"}), "bad_frame", None),
    ("non_string_map_key_binary", _mp({b"type": "ping"}), "bad_frame", None),
    # malformed msgpack
    ("invalid_msgpack_c1", bytes.fromhex("c1"), "bad_frame", None),
    ("empty_message", b"", "bad_frame", None),
    ("truncated_msgpack", _mp(_chat())[:-3], "bad_frame", None),
    ("truncated_str_header", bytes.fromhex("81a474797065db00"), "bad_frame", None),
    ("trailing_bytes", _mp({"type": "ping"}) + b"\x00", "bad_frame", None),
    ("two_frames_in_one_message", _mp({"type": "ping"}) * 2, "bad_frame", None),
    ("invalid_utf8_string", bytes.fromhex("81a474797065a4ff70696e67"), "bad_frame", None),
    ("text_message_on_msgpack", '{"type":"ping"}', "bad_frame", None),
    # chat: id
    ("chat_missing_id", _mp({"type": "chat", "content": "Hi"}), "bad_frame", None),
    ("chat_id_null", _mp(_chat(id=None)), "bad_frame", None),
    ("chat_id_int", _mp(_chat(id=42)), "bad_frame", None),
    ("chat_id_binary", _mp(_chat(id=b"req-1")), "bad_frame", None),
    ("chat_id_empty", _mp(_chat(id="")), "bad_frame", None),
    ("chat_id_65_chars", _mp(_chat(id="x" * (MAX_ID_CHARS + 1))), "bad_frame", None),
    ("chat_id_newline", _mp(_chat(id="req\n1")), "bad_frame", None),
    ("chat_id_nul", _mp(_chat(id="req\x001")), "bad_frame", None),
    ("chat_id_del", _mp(_chat(id="req\x7f")), "bad_frame", None),
    # chat: content / messages
    (
        "chat_content_and_messages",
        _mp(_chat(messages=[{"role": "user", "content": "Hi"}])),
        "bad_frame",
        "req-1",
    ),
    ("chat_neither_content_nor_messages", _mp({"type": "chat", "id": "req-1"}), "bad_frame", "req-1"),
    ("chat_content_null_no_messages", _mp(_chat(content=None)), "bad_frame", "req-1"),
    ("chat_content_int", _mp(_chat(content=7)), "bad_frame", "req-1"),
    ("chat_content_binary", _mp(_chat(content=b"Hi")), "bad_frame", "req-1"),
    ("chat_content_empty", _mp(_chat(content="")), "bad_frame", "req-1"),
    ("chat_messages_not_array", _mp({"type": "chat", "id": "req-1", "messages": "Hi"}), "bad_frame", "req-1"),
    ("chat_messages_empty", _mp({"type": "chat", "id": "req-1", "messages": []}), "bad_frame", "req-1"),
    (
        "chat_messages_too_many",
        _mp({"type": "chat", "id": "req-1", "messages": [{"role": "user", "content": "x"}] * 257}),
        "bad_frame",
        "req-1",
    ),
    ("chat_message_not_map", _mp({"type": "chat", "id": "req-1", "messages": ["Hi"]}), "bad_frame", "req-1"),
    (
        "chat_message_bad_role",
        _mp({"type": "chat", "id": "req-1", "messages": [{"role": "robot", "content": "Hi"}]}),
        "bad_frame",
        "req-1",
    ),
    (
        "chat_message_missing_role",
        _mp({"type": "chat", "id": "req-1", "messages": [{"content": "Hi"}]}),
        "bad_frame",
        "req-1",
    ),
    (
        "chat_message_missing_content",
        _mp({"type": "chat", "id": "req-1", "messages": [{"role": "user"}]}),
        "bad_frame",
        "req-1",
    ),
    (
        "chat_message_content_int",
        _mp({"type": "chat", "id": "req-1", "messages": [{"role": "user", "content": 1}]}),
        "bad_frame",
        "req-1",
    ),
    # chat: params
    ("chat_params_not_map", _mp(_chat(params=[256, 0.7])), "bad_frame", "req-1"),
    ("chat_params_string", _mp(_chat(params="max_tokens=1")), "bad_frame", "req-1"),
    ("chat_temperature_3", _mp(_params(temperature=3)), "bad_frame", "req-1"),
    ("chat_temperature_negative", _mp(_params(temperature=-0.1)), "bad_frame", "req-1"),
    ("chat_temperature_string", _mp(_params(temperature="0.7")), "bad_frame", "req-1"),
    ("chat_temperature_boolean", _mp(_params(temperature=True)), "bad_frame", "req-1"),
    ("chat_temperature_nan", _mp(_params(temperature=math.nan)), "bad_frame", "req-1"),
    ("chat_temperature_infinity", _mp(_params(temperature=math.inf)), "bad_frame", "req-1"),
    ("chat_top_p_0", _mp(_params(top_p=0)), "bad_frame", "req-1"),
    ("chat_top_p_above_1", _mp(_params(top_p=1.01)), "bad_frame", "req-1"),
    ("chat_max_tokens_boolean", _mp(_params(max_tokens=True)), "bad_frame", "req-1"),
    ("chat_max_tokens_0", _mp(_params(max_tokens=0)), "bad_frame", "req-1"),
    ("chat_max_tokens_too_large", _mp(_params(max_tokens=MAX_MAX_TOKENS + 1)), "bad_frame", "req-1"),
    ("chat_max_tokens_float", _mp(_params(max_tokens=16.0)), "bad_frame", "req-1"),
    ("chat_top_k_negative", _mp(_params(top_k=-1)), "bad_frame", "req-1"),
    ("chat_top_k_too_large", _mp(_params(top_k=1001)), "bad_frame", "req-1"),
    ("chat_seed_negative", _mp(_params(seed=-1)), "bad_frame", "req-1"),
    ("chat_cache_not_boolean", _mp(_params(cache="no")), "bad_frame", "req-1"),
    ("chat_seed_above_int64", _mp(_params(seed=2**63)), "bad_frame", "req-1"),
    ("chat_stop_too_many", _mp(_params(stop=["a", "b", "c", "d", "e"])), "bad_frame", "req-1"),
    ("chat_stop_empty_string", _mp(_params(stop=[""])), "bad_frame", "req-1"),
    ("chat_stop_too_long", _mp(_params(stop=["s" * (MAX_STOP_CHARS + 1)])), "bad_frame", "req-1"),
    ("chat_stop_not_string", _mp(_params(stop=[1])), "bad_frame", "req-1"),
    ("chat_stop_map", _mp(_params(stop={"a": "b"})), "bad_frame", "req-1"),
    # resume, cancel, ping
    ("resume_missing_id", _mp({"type": "resume", "offset": 0}), "bad_frame", None),
    ("resume_missing_offset", _mp({"type": "resume", "id": "req-1"}), "bad_frame", "req-1"),
    ("resume_negative_offset", _mp({"type": "resume", "id": "req-1", "offset": -1}), "bad_frame", "req-1"),
    (
        "resume_epoch_zero",
        _mp({"type": "resume", "id": "req-1", "offset": 0, "epoch": 0}),
        "bad_frame",
        "req-1",
    ),
    (
        "resume_epoch_string",
        _mp({"type": "resume", "id": "req-1", "offset": 0, "epoch": "1"}),
        "bad_frame",
        "req-1",
    ),
    ("resume_offset_float", _mp({"type": "resume", "id": "req-1", "offset": 1.5}), "bad_frame", "req-1"),
    ("resume_offset_string", _mp({"type": "resume", "id": "req-1", "offset": "0"}), "bad_frame", "req-1"),
    ("resume_offset_boolean", _mp({"type": "resume", "id": "req-1", "offset": False}), "bad_frame", "req-1"),
    ("resume_offset_null", _mp({"type": "resume", "id": "req-1", "offset": None}), "bad_frame", "req-1"),
    ("cancel_missing_id", _mp({"type": "cancel"}), "bad_frame", None),
    ("cancel_id_array", _mp({"type": "cancel", "id": ["req-1"]}), "bad_frame", None),
    ("ping_ts_string", _mp({"type": "ping", "ts": "now"}), "bad_frame", None),
    ("ping_ts_boolean", _mp({"type": "ping", "ts": True}), "bad_frame", None),
    ("ping_ts_nan", _mp({"type": "ping", "ts": math.nan}), "bad_frame", None),
    # hello
    ("hello_missing_v", _mp({"type": "hello"}), "bad_frame", None),
    ("hello_coalesce_too_big", _mp({"type": "hello", "v": 1, "coalesce_ms": 1001}), "bad_frame", None),
    ("hello_v_string", _mp({"type": "hello", "v": "1"}), "bad_frame", None),
    ("hello_v_boolean", _mp({"type": "hello", "v": True}), "bad_frame", None),
    ("hello_v_float", _mp({"type": "hello", "v": 1.0}), "bad_frame", None),
    ("hello_v_2", _mp({"type": "hello", "v": 2}), "unsupported_version", None),
    ("hello_v_0", _mp({"type": "hello", "v": 0}), "unsupported_version", None),
    ("hello_token_int", _mp({"type": "hello", "v": 1, "token": 1}), "bad_frame", None),
    (
        "hello_token_too_long",
        _mp({"type": "hello", "v": 1, "token": "t" * (MAX_TOKEN_CHARS + 1)}),
        "bad_frame",
        None,
    ),
    ("hello_session_token_map", _mp({"type": "hello", "v": 1, "session_token": {}}), "bad_frame", None),
    (
        "hello_resume_not_array",
        _mp({"type": "hello", "v": 1, "resume": {"id": "r", "offset": 0}}),
        "bad_frame",
        None,
    ),
    ("hello_resume_point_not_map", _mp({"type": "hello", "v": 1, "resume": ["req-1"]}), "bad_frame", None),
    (
        "hello_resume_point_missing_id",
        _mp({"type": "hello", "v": 1, "resume": [{"offset": 0}]}),
        "bad_frame",
        None,
    ),
    (
        "hello_resume_point_negative_offset",
        _mp({"type": "hello", "v": 1, "resume": [{"id": "req-1", "offset": -5}]}),
        "bad_frame",
        "req-1",
    ),
    (
        "hello_resume_too_many",
        _mp({"type": "hello", "v": 1, "resume": [{"id": "r", "offset": 0}] * 257}),
        "bad_frame",
        None,
    ),
]

# (name, message text for the JSON subprotocol, expected code, expected id)
_JSON_INVALID: list[tuple[str, bytes | str, str, str | None]] = [
    ("json_binary_message_on_json", b'{"type":"ping"}', "bad_frame", None),
    ("json_invalid", '{"type":', "bad_frame", None),
    ("json_empty_message", "", "bad_frame", None),
    ("json_single_quotes", "{'type':'ping'}", "bad_frame", None),
    ("json_trailing_garbage", '{"type":"ping"} x', "bad_frame", None),
    ("json_two_objects", '{"type":"ping"}{"type":"ping"}', "bad_frame", None),
    ("json_nan", '{"type":"ping","ts":NaN}', "bad_frame", None),
    (
        "json_infinity",
        '{"type":"chat","id":"req-1","content":"Hi","params":{"temperature":Infinity}}',
        "bad_frame",
        None,
    ),
    ("json_overflowing_float", '{"type":"ping","ts":1e999}', "bad_frame", None),
    ("json_array", '["chat","req-1","Hi"]', "bad_frame", None),
    ("json_null", "null", "bad_frame", None),
    ("json_string", '"ping"', "bad_frame", None),
    ("json_number", "1", "bad_frame", None),
    ("json_unknown_type", '{"type":"subscribe"}', "bad_frame", None),
    ("json_missing_type", '{"id":"req-1","content":"Hi"}', "bad_frame", None),
    ("json_chat_id_65_chars", json.dumps(_chat(id="x" * (MAX_ID_CHARS + 1))), "bad_frame", None),
    ("json_chat_id_escaped_control", '{"type":"chat","id":"a\\u0007b","content":"Hi"}', "bad_frame", None),
    ("json_chat_both", json.dumps(_chat(messages=[{"role": "user", "content": "Hi"}])), "bad_frame", "req-1"),
    ("json_chat_temperature_3", json.dumps(_params(temperature=3)), "bad_frame", "req-1"),
    ("json_chat_max_tokens_boolean", json.dumps(_params(max_tokens=True)), "bad_frame", "req-1"),
    ("json_chat_max_tokens_float", json.dumps(_params(max_tokens=1e2)), "bad_frame", "req-1"),
    ("json_hello_v_2", '{"type":"hello","v":2}', "unsupported_version", None),
    ("json_hello_v_string", '{"type":"hello","v":"1"}', "bad_frame", None),
]


def _invalid(name: str, subprotocol: str, data: bytes | str, code: str, id: str | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": name, "subprotocol": subprotocol}
    if isinstance(data, bytes):
        entry["data_hex"] = data.hex()
    else:
        entry["data_text"] = data
    entry["expected_code"] = code
    entry["expect_id"] = id
    return entry


# --------------------------------------------------------------------------------------------------


def build() -> dict[str, Any]:
    valid = [_valid(n, "client", f) for n, f in client_frames()]
    valid += [_valid(n, "server", f) for n, f in server_frames()]
    invalid = [_invalid(n, MSGPACK_SUBPROTOCOL, d, c, i) for n, d, c, i in _MSGPACK_INVALID]
    invalid += [_invalid(n, JSON_SUBPROTOCOL, d, c, i) for n, d, c, i in _JSON_INVALID]
    names = [v["name"] for v in valid] + [v["name"] for v in invalid]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise AssertionError(f"duplicate vector names: {duplicates}")
    return {"version": VERSION, "valid": valid, "invalid": invalid}


def render() -> str:
    """The exact text of ``frames.json`` (stable: the test compares it byte for byte)."""
    return json.dumps(build(), indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = render()
    if args == ["--check"]:
        if PATH.read_text(encoding="utf-8") != text:
            print(f"{PATH} is stale: run python -m protocol.vectors.generate", file=sys.stderr)
            return 1
        return 0
    if args:
        print("usage: python -m protocol.vectors.generate [--check]", file=sys.stderr)
        return 2
    PATH.write_text(text, encoding="utf-8")
    data = json.loads(text)
    print(f"wrote {PATH}: {len(data['valid'])} valid, {len(data['invalid'])} invalid vectors")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
