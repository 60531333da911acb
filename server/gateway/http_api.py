"""The OpenAI-compatible HTTP API: its routing table, errors, identity, and its use of the store.

Both doors share one state machine: an HTTP call becomes a tokenwire ``chat`` (validated by the same
protocol code as a WebSocket frame) and an ordinary request in the store, whose id is the
``Idempotency-Key`` (or one the server picks) scoped to the owner. Everything this API asks of the store
goes through :class:`HttpApi`'s few methods below, so the store can change underneath in one place.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, cast

import structlog
from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from protocol import Chat, ErrorCode, ProtocolError, parse_client_frame
from protocol.frames import MAX_MODEL_CHARS
from server import metrics
from server.gateway.auth import authenticate_user
from server.gateway.front_door import is_http_api
from server.gateway.http_conn import HttpConnection, HttpRequest, HttpResponse
from server.gateway.models import DEFAULT_ALIAS
from server.gateway.submit import ChatRequest, Submitted, submit_chat
from server.store.logs import LogEntry
from server.store.requests import RequestView

if TYPE_CHECKING:
    from server.gateway.server import Gateway

log = structlog.get_logger(__name__)

MAX_BODY_BYTES = 1 << 20  # 1 MiB, as a WebSocket frame
ID_RE = re.compile(r"^[\x21-\x7e]{1,64}$")  # Idempotency-Key: 1-64 printable ASCII characters


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


def from_protocol(exc: ProtocolError) -> ApiError:
    """A chat the protocol refused, as an HTTP 400 naming the field (``params.x`` → ``x``)."""
    field_name = exc.message.split(":", 1)[0].strip()
    param = field_name.removeprefix("params.") if ":" in exc.message else None
    return bad(exc.message.replace("params.", ""), param=param)


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is calling: the owner of the requests it creates, and whether it gave an Idempotency-Key."""

    owner: str
    user: str | None
    weight: float = 1.0  # fair-share weight from the JWT tier claim, as on the WebSocket


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    pattern: re.Pattern[str]
    handler: Callable[[HttpRequest, Caller, dict[str, str]], Awaitable[HttpResponse]]


class HttpApi:
    """The routing table and the store calls every HTTP endpoint shares."""

    def __init__(self, gw: Gateway) -> None:
        from server.gateway import openai_chat, openai_responses

        self.gw = gw
        self.connections: set[HttpConnection] = set()
        chat = openai_chat.ChatCompletions(self)
        responses = openai_responses.Responses(self)

        def p(pattern: str) -> re.Pattern[str]:
            return re.compile("^" + re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", pattern) + "$")

        # The one routing table: a path that matches no row is 404; a path whose rows all name other
        # methods is 405 (with Allow).
        self.routes: list[Route] = [
            Route("GET", p("/v1/models"), self._models),
            Route("GET", p("/v1/models/{model}"), self._model),
            Route("POST", p("/v1/chat/completions"), chat.create),
            Route("POST", p("/v1/responses"), responses.create),
            Route("GET", p("/v1/responses/{id}"), responses.retrieve),
            Route("POST", p("/v1/responses/{id}/cancel"), responses.cancel),
        ]

    # ---- dispatch -------------------------------------------------------------------------------

    def connection(self) -> HttpConnection:
        """A new HTTP connection (the front door calls this when a connection's first request is ours)."""
        st = self.gw.settings
        return HttpConnection(
            self.handle,
            lambda status, message: ApiError(status, message).response(),
            max_body=MAX_BODY_BYTES,
            idle_timeout_s=max(st.slow_reader_timeout_s, 10.0),
            write_timeout_s=st.slow_reader_timeout_s,
            registry=self.connections,
        )

    async def handle(self, req: HttpRequest) -> HttpResponse:
        if not is_http_api(req.path):
            return self._plain(req)
        try:
            allowed: list[str] = []
            for route in self.routes:
                m = route.pattern.match(req.path)
                if m is None:
                    continue
                if route.method != req.method:
                    allowed.append(route.method)
                    continue
                caller = self.caller(req)
                return await route.handler(req, caller, m.groupdict())
            if allowed:
                err = ApiError(405, f"method {req.method} not allowed on {req.path}"[:200], code="method")
                resp = err.response()
                resp.headers.append(("Allow", ", ".join(sorted(set(allowed)))))
                return resp
            raise ApiError(404, f"no such endpoint: {req.path}"[:200], code="unknown_url")
        except ApiError as exc:
            metrics.ERRORS.labels(f"http_{exc.status}").inc()
            return exc.response()

    def _plain(self, req: HttpRequest) -> HttpResponse:
        """A path outside the API on a kept-alive API connection (e.g. a client pool that asks for
        /healthz too): answered by the gateway's own plain-HTTP handler, exactly as on a fresh
        connection, and the connection closes after it (as websockets closes it)."""
        request = Request(req.target, Headers(list(req.headers.items())))
        request.method = req.method
        answer = self.gw._process_request(cast(ServerConnection, _Responder()), request)
        if answer is None:  # /v1/ws: an upgrade must be the first request of its connection
            answer = _Responder().respond(
                HTTPStatus.BAD_REQUEST, "a WebSocket must open its own connection\n"
            )
        headers = [
            (k, v) for k, v in answer.headers.raw_items() if k.lower() not in ("content-length", "connection")
        ]
        return HttpResponse(
            answer.status_code, [*headers, ("Connection", "close")], bytes(answer.body or b"")
        )

    def caller(self, req: HttpRequest) -> Caller:
        """The owner, as on the WebSocket: the JWT's ``sub`` when auth is on. With auth off the bearer
        key (any string, e.g. the SDK's api_key) scopes the requests, so two clients with different keys
        cannot see each other's; without one every anonymous caller shares one owner."""
        auth = req.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        bearer = token.strip() if scheme.lower() == "bearer" else ""
        if self.gw.settings.auth_secret is not None:
            try:
                user, weight = authenticate_user(bearer or None, self.gw.settings.auth_secret)
            except ProtocolError as exc:
                raise ApiError(
                    401, exc.message.replace("hello.token", "Authorization"), code="invalid_api_key"
                ) from None
            assert user is not None
            return Caller(owner=user, user=user, weight=weight)
        if not bearer:
            return Caller(owner="http:anonymous", user=None)
        return Caller(owner="http:" + hashlib.sha256(bearer.encode()).hexdigest()[:32], user=None)

    # ---- shared helpers for the endpoints ----------------------------------------------------------

    async def model_names(self) -> list[str]:
        """The served models (the default first) and the alias ``default``; in a cluster, the models of
        the live workers."""
        return [*(await self.gw.models.served()).names, DEFAULT_ALIAS]

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
            body = json.loads(req.body, parse_constant=_no_constant)
        except (ValueError, RecursionError) as exc:
            raise bad(f"the body is not valid JSON: {exc}"[:200]) from None
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
            raise bad("Idempotency-Key: 1-64 printable ASCII characters", param="Idempotency-Key")
        return key, True

    @staticmethod
    def to_chat(id: str, messages: list[dict[str, str]], params: dict[str, Any]) -> Chat:
        """The tokenwire chat this call means, validated exactly as a WebSocket ``chat`` frame."""
        raw = {"type": "chat", "id": id, "messages": messages, "params": params}
        try:
            frame = parse_client_frame(raw)
        except ProtocolError as exc:
            raise from_protocol(exc) from None
        assert isinstance(frame, Chat)
        return frame

    async def submit(
        self, caller: Caller, chat: Chat, *, kind: str, extra: dict[str, Any], background: bool = False
    ) -> Submitted:
        """Create the request (or attach to the one with this id) through the same function as a
        WebSocket ``chat`` (submit.py): the same defaults, model choice, degradation ladder, response
        cache and store script; only the per-user rate limit is checked here. Raises ApiError."""
        gw = self.gw
        wait = await gw.store.rate(caller.owner, "chat", gw.settings.chat_rate_per_user)
        if wait:
            raise ApiError(429, "too many requests for this user", code="rate_limited", retry_after_ms=wait)
        try:
            sub = await submit_chat(
                gw,
                ChatRequest(
                    owner=caller.owner,
                    chat=chat,
                    messages=[m.to_wire() for m in chat.messages or ()],
                    # What decides retry vs. conflict: the generation's inputs, the model included (not
                    # stream, stream_options or user).
                    fingerprint=hashlib.sha256(f"{kind}\n{chat.canonical()}".encode()).hexdigest(),
                    weight=caller.weight,
                    extra={"api": kind, "created": int(time.time()), **extra},
                    # Nobody has to stay attached to a background response: it lives until it ends (or
                    # the store's bound on unfinished requests), like a job.
                    detach_timeout_ms=gw.store.settings.unfinished_ttl_ms if background else None,
                ),
            )
        except ProtocolError as exc:
            raise api_error(exc) from None
        log.info("http.request_accepted", request_id=chat.id, outcome=sub.result.outcome, api=kind)
        return sub

    async def follow(
        self, owner: str, id: str, offset: int = 0, *, attached: bool = True
    ) -> AsyncIterator[list[LogEntry]]:
        """The request's log from token ``offset``: batches of entries as they come (replay, then live),
        the last batch ending with the end entry. ``attached``: while this runs, the request counts as
        having a client (the detach timeout does not run). Raises ApiError(resume_failed) when
        ``offset`` is not a boundary of the log."""
        gw = self.gw
        req_key = gw.store.keys.request(owner, id)
        sub = gw.reader.subscribe(gw.store.keys.log(owner, id), offset)
        if attached:
            gw.attach(req_key)
            await gw.store.touch([req_key])
        try:
            expected = offset
            while True:
                batch = [await sub.queue.get()]
                while batch[-1].finish is None and not sub.queue.empty():
                    batch.append(sub.queue.get_nowait())
                if batch[0].offset != expected:
                    raise ApiError(
                        400,
                        f"offset {offset} is not at a delta boundary of this response",
                        param="starting_after",
                        code="resume_failed",
                    )
                expected = batch[-1].offset + batch[-1].n
                yield batch
                if batch[-1].finish is not None:
                    return
        finally:
            if attached:
                gw.detach(req_key)
            gw.reader.unsubscribe(sub)

    async def view(self, owner: str, id: str) -> RequestView | None:
        return await self.gw.store.view(owner, id)

    async def cancel(self, owner: str, id: str) -> str | None:
        return await self.gw.store.cancel(owner, id)

    async def cancel_quietly(self, owner: str, id: str) -> None:
        """Cancel a request nobody can re-attach to (its client dropped before the end)."""
        try:
            await asyncio.shield(self.gw.store.cancel(owner, id))
        except Exception as exc:
            log.warning("http.cancel_failed", request_id=id, error=str(exc))

    # ---- /v1/models --------------------------------------------------------------------------------

    async def _models(self, req: HttpRequest, caller: Caller, args: dict[str, str]) -> HttpResponse:
        names = await self.model_names()
        return json_response({"object": "list", "data": [_model_card(m) for m in names]})

    async def _model(self, req: HttpRequest, caller: Caller, args: dict[str, str]) -> HttpResponse:
        if args["model"] not in await self.model_names():
            raise ApiError(404, f"model {args['model'][:80]!r} is not served here", code="model_not_found")
        return json_response(_model_card(args["model"]))


class _Responder:
    """What the gateway's plain-HTTP handler needs of a websockets connection: ``respond``."""

    def respond(self, status: HTTPStatus, text: str) -> Response:
        body = text.encode()
        headers = Headers([("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))])
        return Response(status.value, status.phrase, headers, body)


def _model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "tokenwire"}


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
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
