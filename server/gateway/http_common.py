"""What every endpoint of the OpenAI-compatible HTTP API shares: errors in OpenAI's shape, SSE framing,
the caller's identity, body checks, and :class:`HttpCore`, the endpoints' one way into the gateway core.

An HTTP call becomes a tokenwire ``chat`` (validated by the same protocol code as a WebSocket frame) and
an ordinary request in the store, whose id is the ``Idempotency-Key`` (or one the server picks) scoped to
the owner. Every call that creates or follows a request is admitted first (admission.py), with the same
limits as the owner's WebSocket chats and resumes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import structlog

from protocol import Chat, ErrorCode, ProtocolError, parse_client_frame
from protocol.codec import json_error, unicode_only, unique_keys
from protocol.frames import MAX_MODEL_CHARS, MAX_TOKEN_CHARS
from server.defaults import ANONYMOUS_HTTP_OWNER
from server.gateway.admission import Ask, ConnectionLimits, Grant, Kind
from server.gateway.auth import authenticate_user
from server.gateway.core import GatewayCore
from server.gateway.http_conn import HttpRequest, HttpResponse
from server.gateway.models import DEFAULT_ALIAS
from server.gateway.streams import batches
from server.gateway.submit import ChatRequest, Submitted
from server.store.logs import LogEntry, Subscription
from server.store.requests import RequestView

log = structlog.get_logger(__name__)

MAX_BODY_BYTES = 1 << 20  # 1 MiB, as a WebSocket frame
# Idempotency-Key: 1-64 characters that stand for themselves in a URL path (RFC 3986 unreserved and
# sub-delims, ":" and "@"), since a response id made from it goes into /v1/responses/{id}: "/", "?", "#",
# "%" and spaces could not be retrieved or cancelled there, so they are refused.
ID_CHARS = "A-Za-z0-9._~!$&'()*+,;=:@-"
ID_RE = re.compile(f"^[{ID_CHARS}]{{1,64}}$")


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        retry_after_ms: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _ERROR_TYPES.get(status, "invalid_request_error")
        self.retry_after_ms = retry_after_ms

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> HttpResponse:
        headers = [("Content-Type", "application/json")]
        if self.retry_after_ms is not None:
            headers.append(("Retry-After", str(max(1, -(-self.retry_after_ms // 1000)))))
            headers.append(("Retry-After-Ms", str(self.retry_after_ms)))
        if self.status == 401:
            headers.append(("WWW-Authenticate", "Bearer"))
        return HttpResponse(self.status, headers, _dumps(self.body()))


_ERROR_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def json_response(obj: Any, status: int = 200) -> HttpResponse:
    return HttpResponse(status, [("Content-Type", "application/json")], _dumps(obj))


def sse(obj: Any, event: str | None = None) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()


SSE_HEADERS = [
    ("Content-Type", "text/event-stream; charset=utf-8"),
    ("Cache-Control", "no-cache"),
    ("X-Accel-Buffering", "no"),  # proxies (nginx) must not buffer a token stream
]


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code or "invalid_request_error")


def optional_bool(body: dict[str, Any], key: str) -> bool | None:
    """A boolean field of a body or event: None when absent (or null), 400 naming it when not a boolean."""
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise bad(f"{key}: expected a boolean", param=key)
    return v


def api_error(exc: ProtocolError) -> ApiError:
    """A refusal of the shared submit path (submit.py), in the HTTP API's terms (SPEC.md §15.6)."""
    if exc.code == ErrorCode.IDEMPOTENCY_CONFLICT:
        return ApiError(
            409,
            "Idempotency-Key: this key was used for a different request; use a new key for a new one",
            param="Idempotency-Key",
            code="idempotency_conflict",
        )
    if exc.code == ErrorCode.MODEL_NOT_FOUND:
        message = exc.message.replace("params.model", "model")
        return ApiError(404, message, param="model", code="model_not_found")
    if exc.code == ErrorCode.RATE_LIMITED:
        return ApiError(429, exc.message, code="rate_limited", retry_after_ms=exc.retry_after_ms)
    if exc.code == ErrorCode.OVERLOADED:
        return ApiError(503, exc.message, code="overloaded", retry_after_ms=exc.retry_after_ms)
    return from_protocol(exc)


def from_protocol(exc: ProtocolError, names: dict[str, str] | None = None) -> ApiError:
    """A chat the protocol refused, as an HTTP 400 naming the field (``params.x`` → ``x``, or the body's
    own name for it in ``names``)."""
    field_name = exc.message.split(":", 1)[0].strip()
    param = field_name.removeprefix("params.") if ":" in exc.message else None
    message = exc.message.replace("params.", "")
    if param is not None and names and param in names:
        message = names[param] + message[len(param) :]
        param = names[param]
    return bad(message, param=param)


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is calling: the owner of the requests it creates, and whether it gave an Idempotency-Key."""

    owner: str
    user: str | None
    weight: float = 1.0  # fair-share weight from the JWT tier claim, as on the WebSocket


# OpenAI's sampling fields: a call that sets any of them chose how it samples.
OPENAI_SAMPLING = ("temperature", "top_p", "frequency_penalty", "presence_penalty")
# Each penalty's "off": what a call that chose how it samples gets for a penalty it did not send.
PENALTIES_OFF = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}


def openai_sampling(params: dict[str, Any]) -> dict[str, Any]:
    """The sampling an OpenAI client asked for, and only that. The server's default penalties
    (server/defaults.py) are part of the defaults a client that chose nothing gets: a call that sets any
    of OPENAI_SAMPLING gets every penalty it did not send off (OpenAI has no repetition penalty, and its
    frequency and presence penalties default to 0), so ``temperature: 0`` is plain greedy decoding and
    the penalties it sends are the only ones."""
    if not any(k in params for k in OPENAI_SAMPLING):
        return params
    return {**PENALTIES_OFF, **params}


def caller_of(authorization: str, secret: str | None) -> Caller:
    """The owner, as on the WebSocket protocol: the JWT's ``sub`` when auth is on (``secret``). With auth
    off the bearer key (any string, e.g. the SDK's api_key) scopes the requests, so two clients with
    different keys cannot see each other's; without one every anonymous caller shares one owner. Used by
    every OpenAI door: an HTTP request's and a Responses WebSocket handshake's ``Authorization``."""
    scheme, _, token = authorization.partition(" ")
    bearer = token.strip() if scheme.lower() == "bearer" else ""
    if len(bearer) > MAX_TOKEN_CHARS:  # as hello.token's bound (SPEC §15.2), with auth on or off
        raise ApiError(
            401, f"Authorization: longer than {MAX_TOKEN_CHARS} characters", code="invalid_api_key"
        )
    if secret is not None:
        try:
            user, weight = authenticate_user(bearer or None, secret)
        except ProtocolError as exc:
            raise ApiError(
                401, exc.message.replace("hello.token", "Authorization"), code="invalid_api_key"
            ) from None
        assert user is not None
        return Caller(owner=user, user=user, weight=weight)
    if not bearer:
        return Caller(owner=ANONYMOUS_HTTP_OWNER, user=None)
    return Caller(owner="http:" + hashlib.sha256(bearer.encode()).hexdigest()[:32], user=None)


def check_fields(body: dict[str, Any], supported: set[str], neutral: dict[str, Any]) -> None:
    """A 400 for the first field tokenwire would otherwise have to ignore (null counts as absent)."""
    for key, value in body.items():
        if value is None or key in supported:
            continue
        ok = neutral.get(key)
        if ok is not None and ok(value):
            continue
        what = "unsupported value for" if ok is not None else "unsupported parameter"
        raise bad(
            f"{what} {key[:60]!r}: tokenwire does not do this", param=key[:60], code="unsupported_parameter"
        )


def prompt_cache_key(body: dict[str, Any]) -> str:
    """OpenAI's ``prompt_cache_key``, else its ``user`` (which it replaces), checked: a string of at most
    256 characters. Requests of one owner with one key go to one worker (its kept turns, in a cluster);
    keyless callers while auth is off are one caller per key for prompt reuse (SPEC App. A).
    ``safety_identifier`` is checked the same way and not used (tokenwire has no abuse detection)."""
    for field in ("prompt_cache_key", "user", "safety_identifier"):
        value = body.get(field)
        if value is not None and (not isinstance(value, str) or len(value) > 256):
            raise bad(f"{field}: a string of at most 256 characters", param=field)
    return str(body.get("prompt_cache_key") or body.get("user") or "")


def check_metadata(metadata: object) -> dict[str, str]:
    """OpenAI's ``metadata``: at most 16 short string pairs."""
    if metadata is None:
        return {}
    if (
        not isinstance(metadata, dict)
        or len(metadata) > 16
        or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            for k, v in metadata.items()
        )
    ):
        raise bad("metadata: at most 16 string keys (64 chars) and string values (512)", "metadata")
    return metadata


def text_content(content: object, where: str, part_types: tuple[str, ...]) -> str:
    """A message's content: a string, or an array of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in part_types:
                raise bad(
                    f"{where}[{i}]: only text parts ({', '.join(part_types)}) are supported", param=where
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise bad(f"{where}[{i}].text: expected a string", param=where)
            out.append(text)
        return "".join(out)
    raise bad(f"{where}: expected a string or an array of text parts", param=where)


class HttpCore:
    """The endpoints' use of the gateway core: admission, submit, following a log, and the store reads
    they need. Every method that holds something takes the admission grant."""

    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def model_names(self) -> list[str]:
        """The served models (the default first) and the alias ``default``; in a cluster, the models of
        the live workers."""
        return [*(await self.core.models.served()).names, DEFAULT_ALIAS]

    @staticmethod
    def check_model(model: object) -> str:
        """The ``model`` field's type; whether it is served is decided where the chat is submitted
        (unknown: 404 ``model_not_found``)."""
        if not isinstance(model, str) or not model:
            raise bad("model: required (a string; GET /v1/models lists them)", param="model")
        if len(model) > MAX_MODEL_CHARS:
            raise bad(f"model: at most {MAX_MODEL_CHARS} characters", param="model")
        return model

    @staticmethod
    def json_body(req: HttpRequest) -> dict[str, Any]:
        ctype = req.headers.get("content-type", "application/json").split(";", 1)[0].strip().lower()
        if ctype != "application/json":
            raise bad(f"Content-Type must be application/json, not {ctype[:60]!r}")
        try:
            body = loads(req.body)
        except (ValueError, RecursionError) as exc:
            raise bad(f"the body is not valid JSON: {json_error(exc)}"[:200]) from None
        if not isinstance(body, dict):
            raise bad("the body must be a JSON object")
        return body

    @staticmethod
    def request_id(req: HttpRequest, prefix: str = "") -> tuple[str, bool]:
        """The request id: the ``Idempotency-Key`` header, or a new random one. Returns (id, keyed)."""
        key = req.headers.get("idempotency-key")
        if key is None:
            return prefix + secrets.token_hex(12), False
        if not ID_RE.match(key):
            raise bad(
                "Idempotency-Key: 1-64 characters among letters, digits and . _ ~ ! $ & ' ( ) * + , ; = : @ -"
                " (no /, ?, #, % or spaces: the key becomes part of a URL path)",
                param="Idempotency-Key",
            )
        return key, True

    @staticmethod
    def to_chat(
        id: str, messages: list[dict[str, str]], params: dict[str, Any], names: dict[str, str] | None = None
    ) -> Chat:
        """The tokenwire chat this call means, validated exactly as a WebSocket ``chat`` frame. ``names``:
        the body's name of a ``params`` key where it differs (``max_tokens``: ``max_output_tokens``), so a
        refusal names the field the caller sent."""
        raw = {"type": "chat", "id": id, "messages": messages, "params": openai_sampling(params)}
        try:
            frame = parse_client_frame(raw)
        except ProtocolError as exc:
            raise from_protocol(exc, names or {}) from None
        assert isinstance(frame, Chat)
        return frame

    async def admit(
        self,
        caller: Caller,
        id: str,
        *,
        kind: Kind = "chat",
        stream: bool = True,
        chat: Chat | None = None,
        conn: ConnectionLimits | None = None,
    ) -> Grant:
        """The admission step (admission.py) for a call about request ``id``; ``stream``: the call will
        follow the log; ``chat``: what it asks for (its text counts against the byte rate); ``conn``: the
        limits of the caller's own connection (a WebSocket door). Raises ApiError 429 / 503 with
        Retry-After."""
        text = sum(len(m.content) for m in chat.messages or ()) if chat is not None else 0
        try:
            return await self.core.admission.admit(
                Ask(kind, caller.owner, id, conn=conn, weight=caller.weight, stream=stream, text_bytes=text)
            )
        except ProtocolError as exc:
            raise api_error(exc) from None

    async def submit(
        self,
        caller: Caller,
        chat: Chat,
        grant: Grant,
        *,
        kind: str,
        extra: dict[str, Any],
        background: bool = False,
        cache_key: str = "",
    ) -> Submitted:
        """Create the request (or attach to the one with this id) through the same path as a WebSocket
        ``chat`` (submit.py): the same defaults, model choice, degradation ladder, response cache and
        store script. Raises ApiError; the grant stays the caller's to release."""
        try:
            sub = await self.core.submitter.submit(
                ChatRequest(
                    owner=caller.owner,
                    chat=chat,
                    messages=[m.to_wire() for m in chat.messages or ()],
                    # What decides retry vs. conflict: the API, the generation's inputs, the model
                    # included (not stream, stream_options or user), and background, which a retry cannot
                    # change for the request it attaches to.
                    fingerprint=hashlib.sha256(
                        f"{kind}{'+background' if background else ''}\n{chat.canonical()}".encode()
                    ).hexdigest(),
                    extra={"api": kind, "created": int(time.time()), **extra},
                    # Nobody has to stay attached to a background response: it lives until it ends (or
                    # the store's bound on unfinished requests), like a job.
                    detach_timeout_ms=self.core.store.settings.unfinished_ttl_ms if background else None,
                    prompt_cache_key=cache_key,
                ),
                grant,
            )
        except ProtocolError as exc:
            raise api_error(exc) from None
        log.info("http.request_accepted", request_id=chat.id, outcome=sub.result.outcome, api=kind)
        return sub

    @contextlib.asynccontextmanager
    async def follow(
        self, grant: Grant, owner: str, id: str, offset: int = 0, *, attached: bool = True
    ) -> AsyncIterator[AsyncIterator[list[LogEntry]]]:
        """For as long as the block runs, the request's log from token ``offset``: batches of entries as
        they come (replay, then live), the last batch ending with the end entry, whose iteration raises
        ApiError(resume_failed) when ``offset`` is not a boundary of the log. ``attached``: meanwhile the
        request counts as having a client (the detach timeout does not run). Releases ``grant`` when the
        block ends.

        A context manager, not an async generator, so that the subscription ends with the block however
        it ends: a door that stops at a yield of a generator (its client gone mid-send) left it
        suspended, subscribed and counted as attached until it was collected."""
        async with self.core.streams.follow(grant, owner, id, offset, attached=attached) as sub:
            entries = _api_batches(sub, id, offset)
            try:
                yield entries
            finally:
                await entries.aclose()  # not left suspended on a subscription that has ended

    async def view(self, owner: str, id: str) -> RequestView | None:
        return await self.core.store.view(owner, id)

    async def cancel(self, owner: str, id: str) -> str | None:
        return await self.core.store.cancel(owner, id)

    async def cancel_quietly(self, owner: str, id: str) -> None:
        """Cancel a request nobody can re-attach to (its client dropped before the end)."""
        try:
            await asyncio.shield(self.core.store.cancel(owner, id))
        except Exception as exc:
            log.warning("http.cancel_failed", request_id=id, error=str(exc))


async def _api_batches(sub: Subscription, id: str, offset: int) -> AsyncGenerator[list[LogEntry], None]:
    """streams.batches, with a resume point off the log's boundaries as the HTTP error it is."""
    try:
        async for batch in batches(sub, id, offset):
            yield batch
    except ProtocolError as exc:
        raise ApiError(
            400,
            f"offset {offset} is not at a delta boundary of this response",
            param="starting_after",
            code=exc.code.value,
        ) from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(data: str | bytes) -> Any:
    """JSON from a client of the OpenAI doors: ValueError for NaN and Infinity, for an object that repeats
    a key (protocol.codec.unique_keys), and for lone surrogates (protocol.codec.unicode_only), which
    would fail later, when the text is hashed or stored. Bytes must be UTF-8 (SPEC §15.1), whatever a
    charset parameter says: ``json.loads`` would also take UTF-16, UTF-32 and a byte-order mark."""
    if isinstance(data, bytes | bytearray):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"not UTF-8 (byte {exc.start})") from None
    return unicode_only(json.loads(data, parse_constant=_no_constant, object_pairs_hook=unique_keys))


def usage(end: LogEntry) -> dict[str, Any]:
    """A chat completion's usage from its log's end entry (``cached_tokens``: of the prompt tokens, those
    the engine reused)."""
    return {
        "prompt_tokens": end.prompt_tokens,
        "completion_tokens": end.offset,
        "total_tokens": end.prompt_tokens + end.offset,
        "prompt_tokens_details": {"cached_tokens": end.cached_tokens},
    }


def entry_error(end: LogEntry) -> ApiError:
    """The HTTP error for a log that ended without a normal finish."""
    if end.finish == "cancelled":
        return ApiError(409, "the request was cancelled", code="cancelled")
    if end.error_code == ErrorCode.TOO_LARGE:
        return bad(
            end.error_message or "the prompt does not fit the model", "messages", "context_length_exceeded"
        )
    return ApiError(500, end.error_message or "generation failed", code=end.error_code or "internal")
