"""Frame types of wire protocol v1 and their validation.

Every frame on the wire is a map with a ``type`` key. ``parse_client_frame`` turns a decoded map into a
typed frame or raises :class:`ProtocolError` with a message naming the field and what was expected;
``Frame.to_wire()`` gives the map to encode. Unknown keys are ignored (forward compatibility); unknown
``type`` values are not.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from msgpack import ExtType

from protocol.errors import ErrorCode, ProtocolError

PROTOCOL_VERSION = 1

MAX_ID_CHARS = 64
MAX_MESSAGES = 256
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 64
MAX_MAX_TOKENS = 8192
MAX_RESUME_POINTS = 256
MAX_COALESCE_MS = 1000  # hello.coalesce_ms: at most one delta per stream a second
# params.detach_timeout_ms: how long a request may run with nobody attached, asked by a client whose app
# may be away for minutes (a phone in the background); the server lowers it to its own cap (SPEC 4.2).
MAX_DETACH_TIMEOUT_MS = 3_600_000
MAX_TOKEN_CHARS = 4096
ROLES = ("system", "user", "assistant")
FINISH_REASONS = ("stop", "length", "cancelled", "error")
REQUEST_STATES = ("queued", "running", "done", "failed", "cancelled")

Wire: TypeAlias = dict[str, Any]


def _bad(message: str, id: str | None = None) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_FRAME, message, id=id)


def _is_int(v: object) -> bool:
    # bool is an int subclass in Python; on the wire true/false are not numbers.
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    # Any integer msgpack can carry (int64 and uint64: -2**63 .. 2**64-1) or finite float. Integers beyond
    # that (JSON can spell them) are refused: msgpack could not echo them in a pong, and float() of a huge
    # int raises OverflowError.
    if _is_int(v):
        return -(2**63) <= v <= 2**64 - 1  # type: ignore[operator]
    return isinstance(v, float) and math.isfinite(v)


def _got(v: object) -> str:
    """What a field held, for "expected a number" errors: the value itself when it is a number that was
    refused (NaN, an infinity, an integer beyond the wire's range), else its type."""
    return _short(v) if isinstance(v, float) or _is_int(v) else _type_name(v)


def _short(v: object) -> str:
    """A bounded description of a bad value for an error message (never repr of a deep structure)."""
    if isinstance(v, str | int | float | bool) or v is None:
        return repr(v)[:40]
    return _type_name(v)


def _type_name(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if _is_int(v) or isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, bytes):
        return "binary"
    if isinstance(v, ExtType):  # a namedtuple: not an array
        return "msgpack extension type"
    if isinstance(v, list | tuple):
        return "array"
    if isinstance(v, Mapping):
        return "map"
    return type(v).__name__


def _req_id(raw: Mapping[str, Any], where: str = "id") -> str:
    v = raw.get("id")
    if v is None:
        raise _bad(f"{where}: required field missing (string of 1-{MAX_ID_CHARS} characters)")
    return _check_id(v, where)


def _check_id(v: object, where: str) -> str:
    if not isinstance(v, str):
        raise _bad(f"{where}: expected a string of 1-{MAX_ID_CHARS} characters, got {_type_name(v)}")
    if not 1 <= len(v) <= MAX_ID_CHARS:
        raise _bad(f"{where}: expected 1-{MAX_ID_CHARS} characters, got {len(v)}")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in v):
        raise _bad(f"{where}: control characters are not allowed")
    return v


def _offset(v: object, where: str, id: str | None) -> int:
    # At most 2**64-1, as every wire integer (_is_number): JSON can spell more, msgpack cannot.
    if not _is_int(v) or not 0 <= v <= 2**64 - 1:  # type: ignore[operator]
        raise _bad(f"{where}: expected a non-negative integer, got {_type_name(v)} {_short(v)}", id)
    return v  # type: ignore[return-value]


def _opt_str(raw: Mapping[str, Any], key: str, limit: int) -> str | None:
    v = raw.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise _bad(f"{key}: expected a string, got {_type_name(v)}")
    if len(v) > limit:
        raise _bad(f"{key}: longer than {limit} characters")
    return v


# --------------------------------------------------------------------------------------------------
# client -> server


@dataclass(frozen=True, slots=True)
class ResumePoint:
    id: str
    offset: int
    epoch: int | None = None  # the epoch the client's partial text belongs to (from accepted)

    def to_wire(self) -> Wire:
        d: Wire = {"id": self.id, "offset": self.offset}
        if self.epoch is not None:
            d["epoch"] = self.epoch
        return d


@dataclass(frozen=True, slots=True)
class Hello:
    v: int = PROTOCOL_VERSION
    token: str | None = None
    session_token: str | None = None
    resume: tuple[ResumePoint, ...] = ()
    # Deltas of one stream at most every this many ms (SPEC §4.1): fewer frames for a phone's radio.
    coalesce_ms: int | None = None
    type: Literal["hello"] = "hello"

    def to_wire(self) -> Wire:
        d: Wire = {"type": "hello", "v": self.v}
        if self.token is not None:
            d["token"] = self.token
        if self.session_token is not None:
            d["session_token"] = self.session_token
        if self.resume:
            d["resume"] = [p.to_wire() for p in self.resume]
        if self.coalesce_ms is not None:
            d["coalesce_ms"] = self.coalesce_ms
        return d


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str

    def to_wire(self) -> Wire:
        return {"role": self.role, "content": self.content}


# The keys of params, in wire order (see SPEC 4.2).
PARAM_KEYS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "cache",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "model",
    "fallback",
    "detach_timeout_ms",
)
MAX_MODEL_CHARS = 128


@dataclass(frozen=True, slots=True)
class Params:
    """Sampling parameters; ``None`` means the server's default."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    cache: bool | None = None  # False: never answer this request from the response cache
    repetition_penalty: float | None = None  # > 1 discourages any token already in prompt or reply
    frequency_penalty: float | None = None  # OpenAI-style: minus this times the token's count in the reply
    presence_penalty: float | None = None  # OpenAI-style: minus this once the token is in the reply
    model: str | None = None  # a served model's name (welcome.models); None: the server's default
    fallback: bool | None = None  # False: never move this chat to a lighter model under load
    detach_timeout_ms: int | None = None  # keep running this long with nobody attached (0: the default)

    def to_wire(self) -> Wire:
        d: Wire = {}
        for k in PARAM_KEYS:
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        if self.stop:
            d["stop"] = list(self.stop)
        return d


@dataclass(frozen=True, slots=True)
class Chat:
    id: str
    content: str | None = None
    messages: tuple[Message, ...] | None = None
    params: Params = field(default_factory=Params)
    type: Literal["chat"] = "chat"

    def to_wire(self) -> Wire:
        d: Wire = {"type": "chat", "id": self.id}
        if self.content is not None:
            d["content"] = self.content
        if self.messages is not None:
            d["messages"] = [m.to_wire() for m in self.messages]
        p = self.params.to_wire()
        if p:
            d["params"] = p
        return d

    def canonical(self) -> str:
        """The canonical payload: same string ⇔ same request (decides retry vs. idempotency conflict)."""
        body = self.to_wire()
        del body["type"], body["id"]
        return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class Resume:
    id: str
    offset: int
    epoch: int | None = None
    type: Literal["resume"] = "resume"

    def to_wire(self) -> Wire:
        d: Wire = {"type": "resume", "id": self.id, "offset": self.offset}
        if self.epoch is not None:
            d["epoch"] = self.epoch
        return d


@dataclass(frozen=True, slots=True)
class Cancel:
    id: str
    type: Literal["cancel"] = "cancel"

    def to_wire(self) -> Wire:
        return {"type": "cancel", "id": self.id}


@dataclass(frozen=True, slots=True)
class Ping:
    ts: float | int | None = None
    type: Literal["ping"] = "ping"

    def to_wire(self) -> Wire:
        d: Wire = {"type": "ping"}
        if self.ts is not None:
            d["ts"] = self.ts
        return d


ClientFrame: TypeAlias = Hello | Chat | Resume | Cancel | Ping


def _parse_hello(raw: Mapping[str, Any]) -> Hello:
    v = raw.get("v")
    if v is None:
        raise _bad("v: required field missing (protocol version, 1)")
    if not _is_int(v) or not _is_number(v):  # an integer beyond the wire's range is a bad frame (§3)
        raise _bad(f"v: expected an integer, got {_short(v)}")
    if v != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION, f"v: this server speaks protocol version 1, not {v}"
        )
    token = _opt_str(raw, "token", MAX_TOKEN_CHARS)
    session_token = _opt_str(raw, "session_token", MAX_TOKEN_CHARS)
    points: list[ResumePoint] = []
    rv = raw.get("resume")
    if rv is not None:
        if not isinstance(rv, list):
            raise _bad(f"resume: expected an array of {{id, offset}}, got {_type_name(rv)}")
        if len(rv) > MAX_RESUME_POINTS:
            raise _bad(f"resume: at most {MAX_RESUME_POINTS} entries")
        for i, p in enumerate(rv):
            if not isinstance(p, Mapping):
                raise _bad(f"resume[{i}]: expected a map {{id, offset}}, got {_type_name(p)}")
            pid = _req_id(p, f"resume[{i}].id")
            off = _offset(p.get("offset"), f"resume[{i}].offset", pid)
            points.append(ResumePoint(pid, off, _epoch(p.get("epoch"), f"resume[{i}].epoch", pid)))
    coalesce = raw.get("coalesce_ms")
    if coalesce is not None and (not _is_int(coalesce) or not 0 <= coalesce <= MAX_COALESCE_MS):
        raise _bad(f"coalesce_ms: an integer from 0 to {MAX_COALESCE_MS} (ms), got {_short(coalesce)}")
    return Hello(v=v, token=token, session_token=session_token, resume=tuple(points), coalesce_ms=coalesce)


def _parse_params(pv: object, id: str) -> Params:
    if pv is None:
        return Params()
    if not isinstance(pv, Mapping):
        raise _bad(f"params: expected a map, got {_type_name(pv)}", id)

    def num(key: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
        v = pv.get(key)
        if v is None:
            return None
        if not _is_number(v):
            raise _bad(f"params.{key}: expected a finite number, got {_got(v)}", id)
        f = float(v)
        if f < lo or f > hi or (lo_open and f == lo):
            bracket = "(" if lo_open else "["
            # The value as sent: {f:g} showed 2.0000001 as "2", in the range the message says it is not.
            raise _bad(f"params.{key}: expected a number in {bracket}{lo:g}, {hi:g}], got {_short(v)}", id)
        return f

    def integer(key: str, lo: int, hi: int) -> int | None:
        v = pv.get(key)
        if v is None:
            return None
        if not _is_int(v):
            raise _bad(f"params.{key}: expected an integer, got {_type_name(v)}", id)
        if not lo <= v <= hi:
            raise _bad(f"params.{key}: expected an integer in [{lo}, {hi}], got {v}", id)
        return int(v)

    def flag(key: str) -> bool | None:
        v = pv.get(key)
        if v is None:
            return None
        if not isinstance(v, bool):
            raise _bad(f"params.{key}: expected a boolean, got {_type_name(v)}", id)
        return v

    stop_v = pv.get("stop")
    stop: tuple[str, ...] = ()
    if stop_v is not None:
        items = [stop_v] if isinstance(stop_v, str) else stop_v
        if not isinstance(items, list) or len(items) > MAX_STOP_STRINGS:
            raise _bad(f"params.stop: expected a string or an array of at most {MAX_STOP_STRINGS}", id)
        for s in items:
            if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_CHARS:
                raise _bad(f"params.stop: each stop string must have 1-{MAX_STOP_CHARS} characters", id)
        stop = tuple(items)
    model = pv.get("model")
    if model is not None and (not isinstance(model, str) or not 1 <= len(model) <= MAX_MODEL_CHARS):
        raise _bad(
            f"params.model: expected a model name of 1-{MAX_MODEL_CHARS} characters, got {_short(model)}", id
        )
    return Params(
        max_tokens=integer("max_tokens", 1, MAX_MAX_TOKENS),
        temperature=num("temperature", 0.0, 2.0),
        top_p=num("top_p", 0.0, 1.0, lo_open=True),
        top_k=integer("top_k", 0, 1000),
        seed=integer("seed", 0, 2**63 - 1),
        stop=stop,
        cache=flag("cache"),
        repetition_penalty=num("repetition_penalty", 0.0, 2.0, lo_open=True),
        frequency_penalty=num("frequency_penalty", -2.0, 2.0),
        presence_penalty=num("presence_penalty", -2.0, 2.0),
        model=model,
        fallback=flag("fallback"),
        detach_timeout_ms=integer("detach_timeout_ms", 0, MAX_DETACH_TIMEOUT_MS),
    )


def _parse_chat(raw: Mapping[str, Any]) -> Chat:
    id = _req_id(raw)
    content = raw.get("content")
    messages_v = raw.get("messages")
    if (content is None) == (messages_v is None):
        raise _bad("chat: exactly one of content (string) or messages (array) is required", id)
    messages: tuple[Message, ...] | None = None
    if content is not None:
        if not isinstance(content, str):
            raise _bad(f"content: expected a string, got {_type_name(content)}", id)
        if not content:
            raise _bad("content: must not be empty", id)
    else:
        if not isinstance(messages_v, list):
            raise _bad(f"messages: expected an array of {{role, content}}, got {_type_name(messages_v)}", id)
        if not 1 <= len(messages_v) <= MAX_MESSAGES:
            raise _bad(f"messages: expected 1-{MAX_MESSAGES} entries, got {len(messages_v)}", id)
        out = []
        for i, m in enumerate(messages_v):
            if not isinstance(m, Mapping):
                raise _bad(f"messages[{i}]: expected a map {{role, content}}, got {_type_name(m)}", id)
            role, text = m.get("role"), m.get("content")
            if role not in ROLES:
                raise _bad(f"messages[{i}].role: expected one of {', '.join(ROLES)}, got {_short(role)}", id)
            if not isinstance(text, str):
                raise _bad(f"messages[{i}].content: expected a string, got {_type_name(text)}", id)
            out.append(Message(role, text))
        messages = tuple(out)
    return Chat(id=id, content=content, messages=messages, params=_parse_params(raw.get("params"), id))


def _parse_resume(raw: Mapping[str, Any]) -> Resume:
    id = _req_id(raw)
    if "offset" not in raw:
        raise _bad("offset: required field missing (non-negative integer)", id)
    return Resume(
        id=id, offset=_offset(raw["offset"], "offset", id), epoch=_epoch(raw.get("epoch"), "epoch", id)
    )


def _epoch(v: object, where: str, id: str) -> int | None:
    if v is None:
        return None
    if not _is_int(v) or not 1 <= v <= 2**31:  # type: ignore[operator]
        raise _bad(f"{where}: expected a positive integer, got {_type_name(v)} {_short(v)}", id)
    return int(v)  # type: ignore[call-overload,no-any-return]


def _parse_ping(raw: Mapping[str, Any]) -> Ping:
    ts = raw.get("ts")
    if ts is not None and not _is_number(ts):
        raise _bad(f"ts: expected a finite number, got {_got(ts)}")
    return Ping(ts=ts)


_CLIENT_PARSERS: dict[str, Callable[[Mapping[str, Any]], ClientFrame]] = {
    "hello": _parse_hello,
    "chat": _parse_chat,
    "resume": _parse_resume,
    "cancel": lambda raw: Cancel(id=_req_id(raw)),
    "ping": _parse_ping,
}


def _frame_type(raw: object, allowed: Mapping[str, object]) -> tuple[Mapping[str, Any], str]:
    if not isinstance(raw, Mapping):
        raise _bad(f"frame: expected a map with a 'type' key, got {_type_name(raw)}")
    if not all(isinstance(k, str) for k in raw):
        raise _bad("frame: map keys must be strings")
    t = raw.get("type")
    if t is None:
        raise _bad("type: required field missing")
    if not isinstance(t, str) or t not in allowed:
        raise _bad(f"type: unknown frame type {_short(t)}; expected one of {', '.join(allowed)}")
    return raw, t


def parse_client_frame(raw: object) -> ClientFrame:
    """Validate a decoded client frame. Raises ProtocolError (bad_frame, unsupported_version)."""
    m, t = _frame_type(raw, _CLIENT_PARSERS)
    return _CLIENT_PARSERS[t](m)


# --------------------------------------------------------------------------------------------------
# server -> client


@dataclass(frozen=True, slots=True)
class Welcome:
    session: str
    session_token: str
    server: str
    limits: Mapping[str, int] = field(default_factory=dict)
    models: tuple[str, ...] = ()  # the models a chat may name in params.model, the default first
    # Models no worker serves yet (loading, or no worker up): their chats and replies wait in the queue.
    # "default" stands for the default model while its name is unknown (a cluster with no live worker).
    loading: tuple[str, ...] = ()
    v: int = PROTOCOL_VERSION
    type: Literal["welcome"] = "welcome"

    def to_wire(self) -> Wire:
        d: Wire = {
            "type": "welcome",
            "v": self.v,
            "session": self.session,
            "session_token": self.session_token,
            "server": self.server,
            "limits": dict(self.limits),
        }
        if self.models:
            d["models"] = list(self.models)
        if self.loading:
            d["loading"] = list(self.loading)
        return d


@dataclass(frozen=True, slots=True)
class Accepted:
    id: str
    epoch: int
    state: str
    model: str | None = None  # the model that serves the request (after any fallback)
    type: Literal["accepted"] = "accepted"

    def to_wire(self) -> Wire:
        d: Wire = {"type": "accepted", "id": self.id, "epoch": self.epoch, "state": self.state}
        if self.model is not None:
            d["model"] = self.model
        return d


@dataclass(frozen=True, slots=True)
class Waiting:
    """A content-mode turn held until the session's previous turn ends (SPEC §4.2): the server has it,
    and its ``accepted`` (or an error) follows. ``after`` is the turn it waits for, when known."""

    id: str
    after: str | None = None
    type: Literal["waiting"] = "waiting"

    def to_wire(self) -> Wire:
        d: Wire = {"type": "waiting", "id": self.id}
        if self.after is not None:
            d["after"] = self.after
        return d


@dataclass(frozen=True, slots=True)
class Delta:
    id: str
    offset: int
    n: int
    text: str
    type: Literal["delta"] = "delta"

    def to_wire(self) -> Wire:
        return {"type": "delta", "id": self.id, "offset": self.offset, "n": self.n, "text": self.text}


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of prompt_tokens, those whose computation the server reused (SPEC §4)

    def to_wire(self) -> Wire:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
        }


@dataclass(frozen=True, slots=True)
class Done:
    id: str
    finish_reason: str
    offset: int
    usage: Usage
    # With finish_reason cancelled: why, when it was not a cancel ("detach_timeout", written by the
    # store's detach.lua and start.lua, SPEC 10.5); else None.
    cancel_reason: str | None = None
    # With finish_reason length: which limit ended it, "max_tokens" or "context" (the model's context
    # window full, SPEC 12); None from a server that predates it.
    length_reason: str | None = None
    type: Literal["done"] = "done"

    def to_wire(self) -> Wire:
        d: Wire = {
            "type": "done",
            "id": self.id,
            "finish_reason": self.finish_reason,
            "offset": self.offset,
            "usage": self.usage.to_wire(),
        }
        if self.cancel_reason is not None:
            d["cancel_reason"] = self.cancel_reason
        if self.length_reason is not None:
            d["length_reason"] = self.length_reason
        return d


@dataclass(frozen=True, slots=True)
class Error:
    code: str
    message: str
    id: str | None = None
    retry_after_ms: int | None = None
    type: Literal["error"] = "error"

    def to_wire(self) -> Wire:
        d: Wire = {"type": "error", "code": self.code, "message": self.message}
        if self.id is not None:
            d["id"] = self.id
        if self.retry_after_ms is not None:
            d["retry_after_ms"] = self.retry_after_ms
        return d

    @classmethod
    def from_exc(cls, exc: ProtocolError) -> Error:
        return cls(code=exc.code.value, message=exc.message, id=exc.id, retry_after_ms=exc.retry_after_ms)


@dataclass(frozen=True, slots=True)
class Pong:
    ts: float | int | None = None
    type: Literal["pong"] = "pong"

    def to_wire(self) -> Wire:
        d: Wire = {"type": "pong"}
        if self.ts is not None:
            d["ts"] = self.ts
        return d


ServerFrame: TypeAlias = Welcome | Accepted | Waiting | Delta | Done | Error | Pong


def _field(raw: Mapping[str, Any], key: str, kind: type | tuple[type, ...], t: str) -> Any:
    v = raw.get(key)
    if not isinstance(v, kind) or isinstance(v, bool):
        raise _bad(f"{t}.{key}: expected {getattr(kind, '__name__', kind)}, got {_type_name(v)}")
    return v


def _parse_welcome(r: Mapping[str, Any]) -> Welcome:
    limits = r.get("limits", {})
    if not isinstance(limits, Mapping):
        raise _bad("welcome.limits: expected a map")
    models = r.get("models") or []
    if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
        raise _bad("welcome.models: expected an array of strings")
    loading = r.get("loading") or []
    if not isinstance(loading, list) or not all(isinstance(m, str) for m in loading):
        raise _bad("welcome.loading: expected an array of strings")
    return Welcome(
        v=_field(r, "v", int, "welcome"),
        session=_field(r, "session", str, "welcome"),
        session_token=_field(r, "session_token", str, "welcome"),
        server=_field(r, "server", str, "welcome"),
        limits=dict(limits),
        models=tuple(models),
        loading=tuple(loading),
    )


def _parse_done(r: Mapping[str, Any]) -> Done:
    reason = _field(r, "finish_reason", str, "done")
    if reason not in FINISH_REASONS:
        raise _bad(f"done.finish_reason: expected one of {', '.join(FINISH_REASONS)}, got {_short(reason)}")
    u = r.get("usage")
    if not isinstance(u, Mapping):
        raise _bad("done.usage: expected a map {prompt_tokens, completion_tokens}")
    prompt = _offset(u.get("prompt_tokens"), "done.usage.prompt_tokens", None)
    completion = _offset(u.get("completion_tokens"), "done.usage.completion_tokens", None)
    # Added in a minor revision: a server that predates it sends none.
    cached = _offset(u.get("cached_tokens", 0), "done.usage.cached_tokens", None)
    if cached > prompt:
        raise _bad(f"done.usage.cached_tokens: {cached} is more than prompt_tokens {prompt}")
    why = r.get("cancel_reason")  # added in a minor revision; any value is a cancel's (SPEC 10.5)
    if why is not None and (not isinstance(why, str) or reason != "cancelled"):
        raise _bad(f"done.cancel_reason: a string with finish_reason cancelled only, got {_short(why)}")
    limit = r.get("length_reason")  # added in a minor revision, like cancel_reason: any string (SPEC 12)
    if limit is not None and (not isinstance(limit, str) or reason != "length"):
        raise _bad(f"done.length_reason: a string with finish_reason length only, got {_short(limit)}")
    return Done(
        id=_req_id(r),
        finish_reason=reason,
        offset=_offset(r.get("offset"), "done.offset", None),
        usage=Usage(prompt, completion, cached),
        cancel_reason=why,
        length_reason=limit,
    )


def _parse_error(r: Mapping[str, Any]) -> Error:
    rid = r.get("id")
    retry = r.get("retry_after_ms")
    if retry is not None:
        retry = _offset(retry, "error.retry_after_ms", None)
    return Error(
        code=_field(r, "code", str, "error"),
        message=_field(r, "message", str, "error"),
        id=_check_id(rid, "error.id") if rid is not None else None,
        retry_after_ms=retry,
    )


_SERVER_PARSERS: dict[str, Callable[[Mapping[str, Any]], ServerFrame]] = {
    "welcome": _parse_welcome,
    "accepted": lambda r: Accepted(
        id=_req_id(r),
        epoch=_field(r, "epoch", int, "accepted"),
        state=_field(r, "state", str, "accepted"),
        model=_field(r, "model", str, "accepted") if r.get("model") is not None else None,
    ),
    "waiting": lambda r: Waiting(
        id=_req_id(r),
        after=_check_id(r.get("after"), "waiting.after") if r.get("after") is not None else None,
    ),
    "delta": lambda r: Delta(
        id=_req_id(r),
        offset=_offset(r.get("offset"), "delta.offset", None),
        n=_offset(r.get("n"), "delta.n", None),
        text=_field(r, "text", str, "delta"),
    ),
    "done": _parse_done,
    "error": _parse_error,
    "pong": lambda r: Pong(ts=r.get("ts")),
}


def parse_server_frame(raw: object) -> ServerFrame:
    """Validate a decoded server frame (used by clients and the conformance tests)."""
    m, t = _frame_type(raw, _SERVER_PARSERS)
    return _SERVER_PARSERS[t](m)
