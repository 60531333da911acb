"""Prometheus metrics of the gateway and the worker (one process registry; ``/metrics`` serves it).

Names follow Prometheus conventions (``tokenwire_`` prefix, ``_total`` counters, ``_seconds``
histograms). In ``serve`` mode one registry holds both sides; a cluster's gateways and workers each
export their own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    make_wsgi_app,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)

# ---- gateway
CONNECTIONS = Gauge("tokenwire_connections_open", "WebSocket connections open on this gateway")
REQUESTS = Counter(
    "tokenwire_chat_requests_total",
    "chat frames by outcome: new request, idempotent attach, conflict, overloaded, user_limit",
    ["outcome"],
)
RESUMES = Counter("tokenwire_resumes_total", "resume requests (resume frames and hello.resume points)")
ERRORS = Counter("tokenwire_errors_total", "error frames sent, by code", ["code"])
CACHE = Counter(
    "tokenwire_response_cache_total",
    "deterministic chats by response-cache result (hit rate = hit/all)",
    ["result"],
)
DEGRADED = Counter(
    "tokenwire_degraded_total",
    "chats made cheaper under load, by action (clamp_max_tokens, truncate_context)",
    ["action"],
)
FALLBACKS = Counter(
    "tokenwire_fallbacks_total",
    "new chats sent to a lighter model because theirs was overloaded (--fallback MODEL=LIGHT)",
    ["model", "to"],
)
STREAMS = Gauge("tokenwire_streams_attached", "request streams attached to connections on this gateway")
ADMISSION = Counter(
    "tokenwire_admission_total",
    "chats and resumes at the admission step (every door), by kind and result (admitted or error code)",
    ["kind", "result"],
)
WAITING_TURNS = Gauge(
    "tokenwire_waiting_turns", "content-mode turns held on this gateway until their previous turn ends"
)
HTTP_REFUSED = Counter(
    "tokenwire_http_connections_refused_total",
    "HTTP connections refused at the door, by reason (gateway or peer cap)",
    ["reason"],
)
WS_REFUSED = Counter(
    "tokenwire_ws_connections_refused_total",
    "WebSocket handshakes refused by the connection caps, by reason (gateway or peer cap)",
    ["reason"],
)
KEEPALIVE = Counter(
    "tokenwire_keepalive_pings_total",
    "WebSocket Pings sent to connections quiet for the ping interval, by outcome (pong; timeout: 1011)",
    ["outcome"],
)

# ---- worker
RUNNING = Gauge("tokenwire_requests_running", "requests running on this worker's engine")
QUEUE_DEPTH = Gauge(
    "tokenwire_queue_depth", "requests queued in the store for the default model, waiting for a worker"
)
MODEL_QUEUE_DEPTH = Gauge(
    "tokenwire_model_queue_depth",
    "requests queued in the store for each model, waiting for a worker",
    ["model"],
)
FINISHED = Counter(
    "tokenwire_requests_finished_total", "requests ended by this worker, by reason", ["reason"]
)
# Of the "length" ends, those the model's context window cut (done.length_reason "context"): a rising
# share says conversations outgrow the model (a smaller --history-max-messages, or a longer context).
CONTEXT_FULL = Counter(
    "tokenwire_requests_context_full_total",
    "requests this worker ended at the model's context window (finish length, length_reason context)",
)
TOKENS = Counter("tokenwire_tokens_generated_total", "completion tokens written to token logs")
TTFT = Histogram(
    "tokenwire_ttft_seconds",
    "time from a worker starting a request to its first token being logged",
    buckets=_LATENCY_BUCKETS,
)
QUEUE_WAIT = Histogram(
    "tokenwire_queue_wait_seconds",
    "time a request waited in the queue before a worker started it",
    buckets=_LATENCY_BUCKETS,
)
INTER_TOKEN = Histogram(
    "tokenwire_inter_token_seconds",
    "time between a request's consecutive logged deltas, per token",
    buckets=_STEP_BUCKETS,
)
REDIS_RTT = Histogram(
    "tokenwire_redis_step_write_seconds",
    "round trip of one engine step's pipelined write to Redis",
    buckets=_STEP_BUCKETS,
)
KV_USAGE = Gauge("tokenwire_kv_cache_usage_ratio", "share of the engine's KV-cache budget in use")
REQUEUED = Counter("tokenwire_requests_requeued_total", "requests re-queued from workers whose lease lapsed")


class _PromptReuse(Collector):
    """tokenwire_prompt_tokens_reused_total{source}: prompt tokens this process's engine did not feed,
    their KV taken over from a finished turn ("session": the session's cached prefix, or the caller's own
    kept turn without one) or copied from another sequence's prompt start ("shared"). The engine keeps
    the counts; they are read when scraped."""

    def __init__(self) -> None:
        self.read: Callable[[], dict[str, int]] | None = None

    def collect(self) -> Iterable[CounterMetricFamily]:
        read = self.read
        if read is None:
            return
        family = CounterMetricFamily(
            "tokenwire_prompt_tokens_reused",
            "prompt tokens not fed to the model, their KV reused, by source (session, shared)",
            labels=["source"],
        )
        for source, n in sorted(read().items()):
            family.add_metric([source], n)
        yield family


PROMPT_REUSE = _PromptReuse()
REGISTRY.register(PROMPT_REUSE)


def render() -> tuple[bytes, str]:
    """The exposition text and its content type."""
    return generate_latest(), CONTENT_TYPE_LATEST


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # scraped every few seconds: no access log
        return


class MetricsServer:
    """``GET /metrics`` on a port of its own (a gateway's ``--metrics-port``), served from a daemon thread
    so a scrape never waits on the event loop. Other paths are 404, other methods 405."""

    def __init__(self, port: int, host: str) -> None:
        self._metrics = make_wsgi_app()
        self._httpd = make_server(host, port, self, _Server, handler_class=_QuietHandler)
        self.port: int = self._httpd.server_port
        self.url = f"http://{host}:{self.port}/metrics"
        threading.Thread(target=self._httpd.serve_forever, name="metrics", daemon=True).start()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"not found; metrics are at /metrics\n"]
        if environ.get("REQUEST_METHOD") != "GET":
            start_response("405 Method Not Allowed", [("Content-Type", "text/plain"), ("Allow", "GET")])
            return [b"method not allowed; allowed: GET\n"]
        result: Iterable[bytes] = self._metrics(environ, start_response)
        return result

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def serve_metrics(port: int, host: str) -> MetricsServer:
    """Start serving ``/metrics`` on ``host:port`` (0: a free port, see ``.port``)."""
    return MetricsServer(port, host)
