"""The OpenAI-compatible HTTP API's door: its connections, its routing table and the caller's identity.

The endpoints live in openai_chat.py and openai_responses.py and reach the core through
:class:`~server.gateway.http_common.HttpCore`. A path outside the API that arrives on one of this door's
kept-alive connections is answered by ``plain`` (the gateway's own plain-HTTP answer, given by
server.py), exactly as on a fresh connection.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote

from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from server import metrics
from server.gateway.core import GatewayCore
from server.gateway.front_door import is_http_api
from server.gateway.http_common import MAX_BODY_BYTES, ApiError, Caller, HttpCore, caller_of, json_response
from server.gateway.http_conn import ConnectionCaps, HttpConnection, HttpRequest, HttpResponse
from server.gateway.openai_chat import ChatCompletions
from server.gateway.openai_responses import Responses

PlainAnswer = Callable[[Request], Response | None]


# The code SPEC §15.6 gives each answer the connection itself makes, before any route: an HTTP request
# it cannot take (400, 408, 413, 431, 501, 505), the connection caps' 429 and 503, and a server fault.
_CONNECTION_CODES = {
    400: "invalid_request_error",
    408: "request_timeout",
    413: "request_too_large",
    429: "rate_limited",
    431: "headers_too_large",
    500: "internal",
    501: "unsupported_transfer_coding",
    503: "overloaded",
    505: "http_version_not_supported",
}


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    pattern: re.Pattern[str]
    handler: Callable[[HttpRequest, Caller, dict[str, str]], Awaitable[HttpResponse]]


class HttpApi:
    """The routing table, the connection factory and the caller's identity."""

    def __init__(
        self, core: GatewayCore, plain: PlainAnswer, on_closed: Callable[[], None] | None = None
    ) -> None:
        self.core = core
        self.http = HttpCore(core)
        self.plain = plain
        self.connections: set[HttpConnection] = set()
        self.on_closed = on_closed  # told of every closed connection (the gateway's churn collector)
        st = core.settings
        self.caps = ConnectionCaps(st.max_http_connections, st.max_http_connections_per_peer)
        chat = ChatCompletions(self.http)
        responses = Responses(self.http)

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

    def connection(self, *, api: bool = True) -> HttpConnection:
        """A new HTTP connection (the front door calls this for every request but a WebSocket handshake).
        ``api``: its first request is the HTTP API's. Only then is it counted against the HTTP caps and
        told to the churn collector: any other (a health probe, the UI's files, a request line that is
        not HTTP) closes after its one response, and a probe must be answered however full the caps, and
        without making the gateway collect garbage every minute for it."""
        st = self.core.settings
        return HttpConnection(
            self.handle,
            lambda status, message: ApiError(status, message, code=_CONNECTION_CODES.get(status)).response(),
            max_body=MAX_BODY_BYTES,
            idle_timeout_s=st.http_idle_timeout_s,
            request_timeout_s=st.http_request_timeout_s,
            ingress=self.core.admission.ingress,
            write_timeout_s=st.slow_reader_timeout_s,
            registry=self.connections,
            caps=self.caps if api else None,
            on_closed=self.on_closed if api else None,
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
                # Path parameters are percent-decoded, so an id a client quoted matches the one it sent.
                args = {k: unquote(v) for k, v in m.groupdict().items()}
                return await route.handler(req, caller, args)
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
        /healthz too); the connection closes after it (as websockets closes it)."""
        request = Request(req.target, Headers(list(req.headers.items())))
        request.method = req.method
        answer = self.plain(request)
        if answer is None:
            # /v1/ws without an upgrade, or after another request on its connection (RFC 9110 §15.5.22).
            body = b"/v1/ws takes a WebSocket handshake (SPEC 2.1), the first request of its connection\n"
            return HttpResponse(
                HTTPStatus.UPGRADE_REQUIRED.value,
                [
                    ("Content-Type", "text/plain; charset=utf-8"),
                    ("Upgrade", "websocket"),
                    ("Connection", "close"),
                ],
                body,
            )
        headers = [
            (k, v) for k, v in answer.headers.raw_items() if k.lower() not in ("content-length", "connection")
        ]
        return HttpResponse(
            answer.status_code, [*headers, ("Connection", "close")], bytes(answer.body or b"")
        )

    def caller(self, req: HttpRequest) -> Caller:
        return caller_of(req.headers.get("authorization", ""), self.core.settings.auth_secret)

    # ---- /v1/models --------------------------------------------------------------------------------

    async def _models(self, req: HttpRequest, caller: Caller, args: dict[str, str]) -> HttpResponse:
        names = await self.http.model_names()
        return json_response({"object": "list", "data": [_model_card(m) for m in names]})

    async def _model(self, req: HttpRequest, caller: Caller, args: dict[str, str]) -> HttpResponse:
        if args["model"] not in await self.http.model_names():
            raise ApiError(404, f"model {args['model'][:80]!r} is not served here", code="model_not_found")
        return json_response(_model_card(args["model"]))


def _model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "tokenwire"}
