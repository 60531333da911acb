"""The gateway process part: the websockets server, HTTP endpoints, and shared per-process state."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus

import structlog
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from protocol import SUBPROTOCOLS, CloseCode, frames
from server import metrics
from server.aio import cancel_and_wait
from server.defaults import DEFAULT_MAX_TOKENS
from server.gateway.connection import Connection, handle
from server.gateway.front_door import front_door_factory
from server.gateway.http_api import HttpApi
from server.gateway.models import Choice, ModelRegistry
from server.gateway.routing import Router
from server.gateway.static import static_response
from server.gateway.ui_config import content_security_policy, ui_config
from server.metrics import MetricsServer, serve_metrics
from server.store.logs import LogReader, RedisClient
from server.store.requests import RequestStore
from server.store.sessions import SessionStore

log = structlog.get_logger(__name__)

WS_PATH = "/v1/ws"
TTFT_FRESH_S = 10.0  # a model's TTFT reading counts for degradation this long after it was seen

Route = Callable[[ServerConnection, Request], Response | None]


def _metrics_response() -> Response:
    body, content_type = metrics.render()
    headers = Headers([("Content-Type", content_type), ("Content-Length", str(len(body)))])
    return Response(HTTPStatus.OK.value, HTTPStatus.OK.phrase, headers, body)


@dataclass(slots=True)
class GatewaySettings:
    host: str = "127.0.0.1"
    port: int = 8765
    max_frame_bytes: int = 1 << 20
    auth_secret: str | None = None
    ping_interval_s: float = 20.0
    max_tokens: int = frames.MAX_MAX_TOKENS  # cap on params.max_tokens, advertised in welcome.limits
    default_max_tokens: int = DEFAULT_MAX_TOKENS  # when a chat does not say
    # Hostile or buggy clients: limits that answer rate_limited (with retry_after_ms) instead of serving.
    chat_rate_per_connection: float = 10.0  # chats per second, bursts of twice that
    chat_rate_per_user: int = 50  # chats per second per user, across all gateways
    max_streams_per_connection: int = 64  # requests one connection may follow at once
    resume_rate_per_connection: float = 10.0  # resumes per second, bursts of max(2 x that, max_streams)
    resume_rate_per_user: int = 200  # resumes per second per user, across all gateways
    allowed_origins: tuple[str, ...] | None = None  # browser Origins allowed; None: any
    slow_reader_timeout_s: float = 10.0  # a send blocked this long closes the connection (1008)
    response_cache: bool = True  # answer repeated deterministic requests from the store's cache
    # One cache for all users instead of one per user: more hits, but whether a prompt is answered at once
    # tells a user that someone else asked it recently (a side channel); an operator's explicit choice.
    shared_response_cache: bool = False
    # Degradation under load: past either threshold (0 = off), new chats get at most degrade_max_tokens
    # and only the system prompt plus the latest degrade_context_messages messages.
    degrade_queue_depth: int = 0  # requests waiting in the store's queue
    degrade_ttft_s: float = 0.0  # recent time to first token seen by this gateway (moving average)
    degrade_max_tokens: int = 128
    degrade_context_messages: int = 8
    # --fallback MODEL=LIGHT: past a threshold, MODEL's new chats go to LIGHT (rung 3 of the ladder in
    # submit.py), unless the chat says params.fallback false.
    fallbacks: tuple[tuple[str, str], ...] = ()
    # /metrics on a port of its own (None: on the client port, and only while auth is off).
    metrics_port: int | None = None
    metrics_host: str | None = None  # None: the same address as host
    ui_connect: tuple[str, ...] = ()  # WebSocket origins the browser UI may use besides this server's

    def fallback_for(self, model: str) -> str | None:
        return next((light for heavy, light in self.fallbacks if heavy == model), None)


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
        self.store = store
        self.sessions = sessions
        self.settings = settings
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.reader = LogReader(reader_redis, store.keys, self.name)
        self.router = Router(store)
        self.models = ModelRegistry(store)  # serve sets .local to its own models
        self.http = HttpApi(self)  # the OpenAI-compatible HTTP API on the same port (front_door.py)
        self.ready = ready
        self.connections: set[Connection] = set()
        self._attached: dict[str, int] = {}  # request key -> streams of this process attached to it
        # Per model: time from accepting a new chat to its first delta, smoothed, and when last seen.
        self._ttft: dict[str, tuple[float, float]] = {}
        self._queued: dict[str, tuple[float, int]] = {}  # per route: (monotonic time read, queued)
        self._server: Server | None = None
        self._touch_task: asyncio.Task[None] | None = None
        self.routes = self._routes()
        self.metrics_server: MetricsServer | None = None
        self._health_task: asyncio.Task[None] | None = None
        self.store_reachable = True  # the store answered its last ping (/readyz fails while it does not)
        self.model_name: str | None = None  # shown by the UI when this process knows it (serve)

    def attach(self, req_key: str) -> None:
        self._attached[req_key] = self._attached.get(req_key, 0) + 1
        metrics.STREAMS.inc()

    def detach(self, req_key: str) -> None:
        metrics.STREAMS.dec()
        n = self._attached.get(req_key, 0) - 1
        if n > 0:
            self._attached[req_key] = n
        else:
            self._attached.pop(req_key, None)

    async def _touch_loop(self) -> None:
        """Tell the store, a few times per detach timeout, which requests have a client attached here;
        a request nobody touches for the detach timeout is cancelled by the worker at its next step."""
        period = self.store.settings.detach_timeout_ms / 3000
        while True:
            await asyncio.sleep(period)
            try:
                await self.store.touch(list(self._attached))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("gateway.touch_failed", error=str(exc))

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
            if reachable and not self.store_reachable:
                log.info("gateway.store_reachable")
            self.store_reachable = reachable
            await asyncio.sleep(period_s)

    def observe_ttft(self, seconds: float, model: str = "") -> None:
        ewma, _ = self._ttft.get(model, (0.0, 0.0))
        ewma = seconds if not ewma else 0.8 * ewma + 0.2 * seconds
        self._ttft[model] = (ewma, time.monotonic())

    def ttft(self, model: str = "") -> float:
        """The model's recent TTFT as this gateway saw it; 0 once it is older than TTFT_FRESH_S (a model
        whose new chats all fell back gets no new readings, and must get a chance to show it recovered)."""
        ewma, at = self._ttft.get(model, (0.0, 0.0))
        return ewma if time.monotonic() - at <= TTFT_FRESH_S else 0.0

    async def degraded(self, model: Choice | None = None) -> bool:
        """Whether new chats of ``model`` (default: the default model) should go down the degradation
        ladder now (its queue depth or TTFT past a threshold)."""
        st = self.settings
        name, route = (model.name, model.route) if model is not None else ("", "")
        if st.degrade_ttft_s and self.ttft(name) > st.degrade_ttft_s:
            return True
        if not st.degrade_queue_depth:
            return False
        at, queued = self._queued.get(route, (0.0, 0))
        if time.monotonic() - at > 1.0:
            queued = await self.store.queued(route)
            self._queued[route] = (time.monotonic(), queued)
        return queued >= st.degrade_queue_depth

    def limits(self) -> dict[str, int]:
        st = self.settings
        return {
            "max_frame_bytes": st.max_frame_bytes,
            "max_tokens": st.max_tokens,
            "max_streams": st.max_streams_per_connection,
        }

    def _routes(self) -> dict[str, dict[str, Route]]:
        """The plain-HTTP surface of the client port (SPEC §2.3): path -> method -> handler. A handler
        returning None lets the WebSocket handshake go on. Other doors (an HTTP API) add their paths here;
        the browser UI's files are the fallback for GET (see :meth:`_process_request`)."""
        routes: dict[str, dict[str, Route]] = {
            WS_PATH: {"GET": lambda conn, request: None},
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
        handler = methods.get(request.method)
        if handler is None:
            allowed = ", ".join(sorted(methods))
            response = conn.respond(
                HTTPStatus.METHOD_NOT_ALLOWED, f"method not allowed; allowed: {allowed}\n"
            )
            response.headers["Allow"] = allowed
            return response
        return handler(conn, request)

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
        port in use raises OSError and leaves nothing running."""
        open_timeout_s = 10.0  # websockets' default opening-handshake timeout
        self._server = await serve(
            lambda ws: handle(self, ws),
            self.settings.host,
            self.settings.port,
            subprotocols=list(SUBPROTOCOLS),  # type: ignore[arg-type]
            process_request=self._process_request,
            # Browsers send Origin; other clients (apps, scripts) do not, and are allowed (None).
            origins=[*self.settings.allowed_origins, None] if self.settings.allowed_origins else None,  # type: ignore[list-item]
            max_size=self.settings.max_frame_bytes,
            ping_interval=self.settings.ping_interval_s,
            ping_timeout=self.settings.ping_interval_s,
            compression=None,  # per-message deflate costs CPU and memory per socket for ~20-byte frames
            # Every connection's first request line picks websockets or the HTTP API (front_door.py).
            create_connection=front_door_factory(lambda _ws: self.http.connection(), open_timeout_s),  # type: ignore[arg-type]
            open_timeout=open_timeout_s,
        )
        self.reader.start()
        self._touch_task = asyncio.create_task(self._touch_loop(), name="gateway-touch")
        self._health_task = asyncio.create_task(self._health_loop(), name="gateway-store-health")
        sock = next(iter(self._server.sockets))
        port: int = sock.getsockname()[1]
        log.info("gateway.listening", url=f"ws://{self.settings.host}:{port}{WS_PATH}")
        st = self.settings
        if st.metrics_port is not None:
            self.metrics_server = serve_metrics(st.metrics_port, st.metrics_host or st.host)
            log.info("gateway.metrics", url=self.metrics_server.url)
        return port

    async def stop(self) -> None:
        """Stop accepting, then close open connections with 1012 so clients reconnect and resume."""
        if self._server is not None:
            self._server.close(close_connections=False)
            for h in list(self.http.connections):
                h.close()  # HTTP streams end; a client with an Idempotency-Key or a response id resumes
            await asyncio.gather(
                *(c.ws.close(CloseCode.SERVICE_RESTART, "server restarting") for c in list(self.connections)),
                return_exceptions=True,
            )
            await self._server.wait_closed()
        await cancel_and_wait([self._touch_task, self._health_task])
        await self.reader.stop()
        if self.metrics_server is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.metrics_server.stop)
