"""The gateway process: assembles the core (core.py) and the doors on it, one port for all of them.

The websockets server serves the WebSocket doors (connection.py, and the Responses WebSocket); every
other request, the OpenAI-compatible HTTP API and the plain HTTP endpoints (``/``, ``/healthz``,
``/readyz``, ``/metrics``, ``/config.json``) alike, is handed by the front door to http_api.py, which
answers the plain ones through this module's routes (``_process_request``). This module holds process
concerns only (listening, health, drain); every rule about what a client may do lives in the core.
Nothing in the gateway imports this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator, Sequence
from http import HTTPStatus
from typing import cast

import structlog
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import NegotiationError
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from protocol import SUBPROTOCOLS, CloseCode
from server import metrics
from server.aio import cancel_and_wait
from server.gateway import egress, keepalive
from server.gateway.connection import Connection
from server.gateway.core import GatewayCore
from server.gateway.front_door import RESPONSES_PATH, front_door_factory
from server.gateway.http_api import HttpApi
from server.gateway.http_common import ApiError, Caller, caller_of
from server.gateway.http_conn import ConnectionCaps
from server.gateway.ingress import peer_address
from server.gateway.openai_responses_ws import ResponsesSocket
from server.gateway.settings import GatewaySettings
from server.gateway.static import static_response
from server.gateway.ui_config import content_security_policy, ui_config
from server.gctune import ChurnCollector
from server.metrics import MetricsServer, serve_metrics
from server.store.logs import RedisClient
from server.store.requests import RequestStore
from server.store.sessions import SessionStore

log = structlog.get_logger(__name__)


class BindFailed(OSError):
    """A port other than the client port could not be bound: which flag set it, for the one line the
    operator sees (app.bind_error)."""

    def __init__(self, flag: str, host: str, port: int, cause: OSError) -> None:
        super().__init__(cause.errno, cause.strerror)
        self.flag, self.host, self.port = flag, host, port


__all__ = ["WS_PATH", "Gateway", "GatewaySettings"]

WS_PATH = "/v1/ws"

Route = Callable[[ServerConnection, Request], Response | None]


def _metrics_response() -> Response:
    body, content_type = metrics.render()
    headers = Headers([("Content-Type", content_type), ("Content-Length", str(len(body)))])
    return Response(HTTPStatus.OK.value, HTTPStatus.OK.phrase, headers, body)


class Gateway:
    def __init__(
        self,
        store: RequestStore,
        sessions: SessionStore,
        reader_redis: RedisClient,
        settings: GatewaySettings,
        *,
        ready: Callable[[], bool] = lambda: True,
        name: str | None = None,
    ) -> None:
        self.core = GatewayCore(store, sessions, reader_redis, settings, name=name)
        self.store = store
        self.sessions = sessions
        self.settings = settings
        self.name = self.core.name
        self.models = self.core.models  # serve sets .local to its own models
        # Full collections after connection churn (gctune.py): closed connections' garbage goes back.
        self.collector = ChurnCollector()
        # The OpenAI-compatible HTTP API on the same port (front_door.py); a path outside it on one of
        # its connections is answered as a fresh connection's would be.
        self.http = HttpApi(self.core, plain=self._plain_answer, on_closed=self.collector.connection_closed)
        self.ready = ready
        self.connections: set[Connection] = set()
        self.response_sockets: set[ResponsesSocket] = set()  # OpenAI's Responses WebSocket mode
        # The caller each Responses WebSocket handshake authenticated, for its handler: checking the JWT
        # again there could find it expired in between (an uncaught 401 in the handler, a 1011).
        self._callers: weakref.WeakKeyDictionary[object, Caller] = weakref.WeakKeyDictionary()
        self._server: Server | None = None
        self.routes = self._routes()
        self.metrics_server: MetricsServer | None = None
        self._health_task: asyncio.Task[None] | None = None
        # WebSockets of both doors, counted from the handshake's 101 to the handler's end.
        self.ws_caps = ConnectionCaps(
            self.settings.max_ws_connections, self.settings.max_ws_connections_per_peer
        )
        self._collector_task: asyncio.Task[None] | None = None
        self._keepalive_task: asyncio.Task[None] | None = None
        self.store_reachable = True  # the store answered its last ping (/readyz fails while it does not)
        self.model_name: str | None = None  # shown by the UI when this process knows it (serve)
        # A live worker (or this process) serves the default model: /readyz's body says when none does.
        self.default_model_live = False

    async def _health_loop(self, period_s: float = 1.0) -> None:
        """Ping the store every ``period_s``: a gateway that cannot reach it must leave the load balancer
        (/readyz 503) until it can again."""
        while True:
            try:
                await asyncio.wait_for(self.store.ping(), period_s * 2)
                reachable = True
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                reachable = False
                if self.store_reachable:
                    log.warning("gateway.store_unreachable", error=str(exc) or type(exc).__name__)
            if reachable:
                with contextlib.suppress(Exception):  # listing the models never fails the probe
                    self.default_model_live = (await self.models.served()).default is not None
            if reachable and not self.store_reachable:
                log.info("gateway.store_reachable")
            self.store_reachable = reachable
            await asyncio.sleep(period_s)

    def _routes(self) -> dict[str, dict[str, Route]]:
        """The plain-HTTP surface of the client port (SPEC §2.3): path -> method -> handler. A handler
        returning None lets the WebSocket handshake go on. Other doors (an HTTP API) add their paths here;
        the browser UI's files are the fallback for GET (see :meth:`_process_request`)."""
        routes: dict[str, dict[str, Route]] = {
            WS_PATH: {"GET": lambda conn, request: None},
            # Reaches websockets only with an upgrade (front_door.py); the handshake checks the caller.
            RESPONSES_PATH: {"GET": self._responses_handshake},
            "/healthz": {"GET": lambda conn, request: conn.respond(HTTPStatus.OK, "ok\n")},
            "/readyz": {"GET": self._readyz},
            # The UI's defaults and the origins it may connect to (ui_config.py).
            "/config.json": {"GET": self._ui_config},
        }
        if self.public_metrics:
            routes["/metrics"] = {"GET": lambda conn, request: _metrics_response()}
        return routes

    @property
    def public_metrics(self) -> bool:
        """/metrics on the client port: only with no port of its own and auth off (with auth on, anyone
        who can reach the port could read the server's traffic figures)."""
        return self.settings.metrics_port is None and self.settings.auth_secret is None

    def _readyz(self, conn: ServerConnection, request: Request) -> Response:
        if not self.store_reachable:
            return conn.respond(HTTPStatus.SERVICE_UNAVAILABLE, "store unreachable\n")
        if self.ready():
            # A cluster gateway is ready once it reaches the store, with or without workers: it accepts
            # connections, resumes replies from the logs, and queues new chats until a worker takes them.
            # Taking it out of the load balancer while workers load would refuse exactly the clients
            # reconnecting to read what is already logged. The body says what it waits for.
            if not self.default_model_live:
                body = "ready; no live worker serves the default model yet: chats queue until one does\n"
                return conn.respond(HTTPStatus.OK, body)
            return conn.respond(HTTPStatus.OK, "ready\n")
        return conn.respond(HTTPStatus.SERVICE_UNAVAILABLE, "model loading\n")

    def _process_request(self, conn: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0]
        methods = self.routes.get(path)
        if methods is None:
            # The browser chat UI: GET / and its files under /ui/, /src/, /vendor/ (client_js/).
            csp = content_security_policy(request.headers.get("Host"), self.settings.ui_connect)
            static = static_response(request.path, csp=csp)
            if static is None:
                return conn.respond(HTTPStatus.NOT_FOUND, f"not found; the WebSocket endpoint is {WS_PATH}\n")
            methods = {"GET": lambda conn, request: static}
        # HEAD is GET without the body (RFC 9110 §9.3.2): the HTTP door (http_conn.py) leaves it out.
        handler = methods.get("GET" if request.method == "HEAD" else request.method)
        if handler is None:
            allowed = ", ".join(sorted({*methods, "HEAD"} if "GET" in methods else methods))
            response = conn.respond(
                HTTPStatus.METHOD_NOT_ALLOWED, f"method not allowed; allowed: {allowed}\n"
            )
            response.headers["Allow"] = allowed
            return response
        return handler(conn, request)

    def _responses_handshake(self, conn: ServerConnection, request: Request) -> Response | None:
        """The Bearer token of a Responses WebSocket, checked before the upgrade (as on HTTP: 401, and 400
        for more than one Authorization header, SPEC §15.1)."""
        try:
            if len(request.headers.get_all("Authorization")) > 1:
                raise ApiError(400, "more than one Authorization header")
            self._callers[conn] = caller_of(
                request.headers.get("Authorization", ""), self.settings.auth_secret
            )
        except ApiError as exc:
            answer = exc.response()
            headers = Headers([*answer.headers, ("Content-Length", str(len(answer.body)))])
            return Response(exc.status, HTTPStatus(exc.status).phrase, headers, answer.body)
        return None

    def _select_subprotocol(
        self, conn: ServerConnection, offered: Sequence[Subprotocol]
    ) -> Subprotocol | None:
        """/v1/ws needs one of SUBPROTOCOLS; OpenAI's SDKs offer none on /v1/responses (JSON frames)."""
        path = conn.request.path.split("?", 1)[0] if conn.request is not None else ""
        if path == RESPONSES_PATH:
            return None
        for sub in SUBPROTOCOLS:
            if sub in offered:
                return Subprotocol(sub)
        if not offered:
            raise NegotiationError("missing subprotocol")
        raise NegotiationError("invalid subprotocol; expected one of " + ", ".join(SUBPROTOCOLS))

    def _count_websocket(self, ws: ServerConnection, request: Request, response: Response) -> Response | None:
        """After the handshake is accepted and before its 101 goes out: count the WebSocket against the
        gateway's caps (given back when its handler ends), or refuse it 503 (the gateway is full) / 429
        (its peer address holds too many), with ``Retry-After``. Counted here, not in process_request,
        because websockets runs the handler exactly when a 101 was sent, so nothing is counted twice
        or left counted."""
        if response.status_code != 101:
            return None
        status = self.ws_caps.take(peer_address(ws))
        if status == 200:
            return None
        metrics.WS_REFUSED.labels("gateway" if status == 503 else "peer").inc()
        text = (
            "this gateway holds all the WebSockets it may; retry shortly\n"
            if status == 503
            else "too many WebSockets from this address; close some or retry shortly\n"
        )
        refused = ws.respond(HTTPStatus(status), text)
        refused.headers["Retry-After"] = "1"
        return refused

    async def _handle(self, ws: ServerConnection) -> None:
        """A WebSocket: /v1/responses is OpenAI's Responses mode, anything else the protocol door; each
        registered so that a drain can close it."""
        try:
            await self._serve_websocket(ws)
        finally:
            self.ws_caps.give_back(peer_address(ws))
            self.collector.connection_closed()
            # websockets keeps the exception that ended its parser (EOFError at a close), whose
            # traceback holds the parser's frame, which holds the protocol: a cycle keeping the closed
            # connection's buffers until a full collection. Its traceback is of no use now.
            exc = getattr(ws.protocol, "parser_exc", None)
            if exc is not None:
                exc.__traceback__ = None

    async def _serve_websocket(self, ws: ServerConnection) -> None:
        if ws.request is not None and ws.request.path.split("?", 1)[0] == RESPONSES_PATH:
            await self._handle_responses(ws)
            return
        conn = Connection(self.core, ws)
        self.connections.add(conn)
        metrics.CONNECTIONS.inc()
        try:
            await conn.run()
        finally:
            metrics.CONNECTIONS.dec()
            self.connections.discard(conn)
            with contextlib.suppress(Exception):
                await ws.close()

    async def _handle_responses(self, ws: ServerConnection) -> None:
        assert ws.request is not None
        caller = self._callers.pop(ws, None)
        if caller is None:  # every upgrade on this path passed the handshake's check; defensive
            caller = caller_of(ws.request.headers.get("Authorization", ""), self.settings.auth_secret)
        sock = ResponsesSocket(self.http.http, ws, caller)
        self.response_sockets.add(sock)
        metrics.CONNECTIONS.inc()
        try:
            await sock.run()
        finally:
            metrics.CONNECTIONS.dec()
            self.response_sockets.discard(sock)
            with contextlib.suppress(Exception):
                await ws.close()

    def _plain_answer(self, request: Request) -> Response | None:
        return self._process_request(cast(ServerConnection, _Responder()), request)

    def _ui_config(self, conn: ServerConnection, request: Request) -> Response:
        body = ui_config(
            connect=self.settings.ui_connect,
            model=self.model_name,
            max_tokens=self.settings.max_tokens,
            models=self.models.local,
        )
        headers = Headers(
            [
                ("Connection", "close"),  # the server closes after any plain HTTP response
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(body))),
                ("Cache-Control", "no-cache"),
            ]
        )
        return Response(HTTPStatus.OK.value, HTTPStatus.OK.phrase, headers, body)

    async def start(self) -> int:
        """Listen; returns the bound port (useful with port 0). Binds before starting anything else, so a
        port in use raises OSError (BindFailed for the metrics port) and leaves nothing running."""
        open_timeout_s = 10.0  # websockets' default opening-handshake timeout
        st = self.settings
        if st.metrics_port is not None:
            try:
                self.metrics_server = serve_metrics(st.metrics_port, st.metrics_host or st.host)
            except OSError as exc:
                raise BindFailed("--metrics-port", st.metrics_host or st.host, st.metrics_port, exc) from None
        try:
            self._server = await self._serve(open_timeout_s)
        except OSError:
            if self.metrics_server is not None:
                self.metrics_server.stop()
                self.metrics_server = None
            raise
        self.core.start()
        self._health_task = asyncio.create_task(self._health_loop(), name="gateway-store-health")
        self._collector_task = asyncio.create_task(self.collector.run(), name="gateway-churn-gc")
        interval = self.settings.ping_interval_s
        self._keepalive_task = asyncio.create_task(
            keepalive.sweep(self._websockets, interval, interval), name="gateway-keepalive"
        )
        sock = next(iter(self._server.sockets))
        port: int = sock.getsockname()[1]
        log.info("gateway.listening", url=f"ws://{self.settings.host}:{port}{WS_PATH}")
        if self.metrics_server is not None:
            log.info("gateway.metrics", url=self.metrics_server.url)
        return port

    async def _serve(self, open_timeout_s: float) -> Server:
        """The listening WebSocket (and HTTP, front_door.py) server on the client port."""
        return await serve(
            self._handle,
            self.settings.host,
            self.settings.port,
            subprotocols=list(SUBPROTOCOLS),  # type: ignore[arg-type]
            process_request=self._process_request,
            process_response=self._count_websocket,
            # Browsers send Origin; other clients (apps, scripts) do not, and are allowed (None).
            origins=[*self.settings.allowed_origins, None] if self.settings.allowed_origins else None,  # type: ignore[list-item]
            max_size=self.core.admission.max_frame_bytes,
            # Frames read ahead of the handler: at most 2 MiB per connection of 1 MiB frames. The
            # handler paces reading (ingress.py); more read-ahead would only hold more memory.
            max_queue=2,
            # Not websockets' keepalive (a task and a Ping per connection every interval): one sweep pings
            # only the connections quiet for the interval (keepalive.py, started with the server).
            ping_interval=None,
            compression=None,  # per-message deflate costs CPU and memory per socket for ~20-byte frames
            # How long a closing handshake may take, whoever began it (websockets' default: 10 s). It fixes
            # the close deadline when the closing begins: a client that sends its close and keeps its end
            # of the TCP connection, to a door waiting for a frame, is aborted by the keepalive sweep
            # after it (egress.py, keepalive.py).
            close_timeout=egress.CLOSE_TIMEOUT_S,
            # Every connection's first request line picks websockets or the HTTP API (front_door.py).
            create_connection=front_door_factory(
                lambda api: self.http.connection(api=api),
                open_timeout_s,
                self._select_subprotocol,
                self.collector.connection_closed,
            ),  # type: ignore[arg-type]
            open_timeout=open_timeout_s,
        )

    def _websockets(self) -> Iterator[keepalive.GatewayWebSocket]:
        """Every open WebSocket of either door (front_door.py makes each a GatewayWebSocket)."""
        for ws in itertools.chain((c.ws for c in self.connections), (s.ws for s in self.response_sockets)):
            if isinstance(ws, keepalive.GatewayWebSocket):
                yield ws

    async def stop(self) -> None:
        """Stop accepting, then close open connections with 1012 so clients reconnect and resume."""
        if self._server is not None:
            self._server.close(close_connections=False)
            for h in list(self.http.connections):
                h.close()  # HTTP streams end; a client with an Idempotency-Key or a response id resumes
            sockets = [c.ws for c in self.connections] + [s.ws for s in self.response_sockets]
            await asyncio.gather(
                *(ws.close(CloseCode.SERVICE_RESTART, "server restarting") for ws in sockets),
                return_exceptions=True,
            )
            await self._server.wait_closed()
        await cancel_and_wait([self._health_task, self._collector_task, self._keepalive_task])
        await self.core.stop()
        if self.metrics_server is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.metrics_server.stop)


class _Responder:
    """What the plain-HTTP handler needs of a websockets connection (``respond``), for requests that
    arrive on an HTTP API connection instead."""

    def respond(self, status: HTTPStatus, text: str) -> Response:
        body = text.encode()
        headers = Headers([("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))])
        return Response(status.value, status.phrase, headers, body)
