"""params.model / params.fallback, accepted.model and welcome.models (SPEC.md §4.2, §5)."""

from __future__ import annotations

import pytest

from protocol import Accepted, Chat, ErrorCode, Params, ProtocolError, Welcome, parse_client_frame
from protocol.frames import parse_server_frame


def chat(params: object) -> Chat:
    frame = parse_client_frame({"type": "chat", "id": "r1", "content": "hi", "params": params})
    assert isinstance(frame, Chat)
    return frame


def test_model_and_fallback_parse_and_enter_the_fingerprint() -> None:
    c = chat({"model": "light", "fallback": False})
    assert c.params.model == "light" and c.params.fallback is False
    assert c.to_wire()["params"] == {"model": "light", "fallback": False}
    # Another model, or none, is another request (idempotency_conflict for the same id).
    assert c.canonical() != chat({"model": "big", "fallback": False}).canonical()
    assert chat({}).canonical() != chat({"model": "default"}).canonical()
    assert chat({"model": "light"}).canonical() == chat({"model": "light", "fallback": None}).canonical()


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"model": 7}, "params.model"),
        ({"model": ""}, "params.model"),
        ({"model": "m" * 129}, "params.model"),
        ({"model": ["a"]}, "params.model"),
        ({"fallback": "no"}, "params.fallback"),
        ({"fallback": 0}, "params.fallback"),
    ],
)
def test_bad_model_or_fallback_is_a_bad_frame_naming_the_field(params: object, field: str) -> None:
    with pytest.raises(ProtocolError) as exc:
        chat(params)
    assert (
        exc.value.code == ErrorCode.BAD_FRAME and exc.value.message.startswith(field) and exc.value.id == "r1"
    )


def test_accepted_model_and_welcome_models_round_trip() -> None:
    a = Accepted(id="r1", epoch=1, state="queued", model="light")
    assert a.to_wire()["model"] == "light" and parse_server_frame(a.to_wire()) == a
    plain = Accepted(id="r1", epoch=1, state="queued")
    assert "model" not in plain.to_wire() and parse_server_frame(plain.to_wire()) == plain
    w = Welcome(
        session="s", session_token="t", server="gw", limits={"max_tokens": 8}, models=("big", "light")
    )
    assert w.to_wire()["models"] == ["big", "light"] and parse_server_frame(w.to_wire()) == w
    assert "models" not in Welcome(session="s", session_token="t", server="gw").to_wire()
    with pytest.raises(ProtocolError):
        parse_server_frame({**w.to_wire(), "models": [1]})


def test_welcome_loading_round_trips_and_is_left_out_when_empty() -> None:
    w = Welcome(session="s", session_token="t", server="gw", models=("big",), loading=("big",))
    assert w.to_wire()["loading"] == ["big"] and parse_server_frame(w.to_wire()) == w
    plain = Welcome(session="s", session_token="t", server="gw", models=("big",))
    assert "loading" not in plain.to_wire() and parse_server_frame(plain.to_wire()).loading == ()
    assert parse_server_frame({**plain.to_wire(), "loading": None}).loading == ()
    with pytest.raises(ProtocolError):
        parse_server_frame({**w.to_wire(), "loading": "big"})


def test_params_default_has_no_model() -> None:
    assert "model" not in Params().to_wire() and "fallback" not in Params().to_wire()


@pytest.mark.parametrize(
    ("value", "shown"), [(float("nan"), "nan"), (float("inf"), "inf"), (2**64, str(2**64)), (True, "boolean")]
)
def test_a_refused_number_is_named_by_its_value(value: object, shown: str) -> None:
    # "expected a number, got number" said nothing about NaN, an infinity or an integer past the wire's range.
    with pytest.raises(ProtocolError) as ei:
        parse_client_frame({"type": "chat", "id": "x", "content": "hi", "params": {"temperature": value}})
    assert ei.value.message == f"params.temperature: expected a finite number, got {shown}"


def test_detach_timeout_ms_is_an_integer_in_range() -> None:
    """params.detach_timeout_ms (SPEC §4.2): 0 to 3,600,000; anything else is a bad frame naming it."""
    assert chat({"detach_timeout_ms": 600_000}).params.detach_timeout_ms == 600_000
    assert chat({"detach_timeout_ms": 0}).params.detach_timeout_ms == 0
    assert chat({}).params.detach_timeout_ms is None
    assert chat({"detach_timeout_ms": 5}).to_wire()["params"] == {"detach_timeout_ms": 5}
    for bad in (-1, 3_600_001, 1.5, "600", True, [1]):
        with pytest.raises(ProtocolError) as exc:
            chat({"detach_timeout_ms": bad})
        assert exc.value.code == ErrorCode.BAD_FRAME and "params.detach_timeout_ms" in str(exc.value), bad
