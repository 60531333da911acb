"""A worker's HTTP port (``--metrics-port``): ``/metrics`` for Prometheus, ``/healthz`` and ``/readyz`` for
orchestrators.

A worker has no sockets of its own, so before this a probe could only ask ``/metrics``, which answers as
soon as the process starts and long after its engine thread died. Now:

* ``/healthz`` (liveness): 200 while the model is loading, and afterwards while the engine thread is
  alive and the event loop still runs the lease loop (it ticks every lease_ttl / 3); 503 otherwise, so a
  wedged worker gets restarted. A Redis outage is not a liveness failure: restarting would not fix it.
* ``/readyz`` (readiness): 200 only when the model is loaded, the worker is taking work (not draining),
  its last store call succeeded (not while Redis is unreachable: it takes no work then) and its last
  heartbeat reached Redis within the lease TTL; 503 with the reason otherwise.

Served from a thread (as prometheus-client's own server is): answering never waits on the event loop or
the engine, it only reads the worker's state.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

if TYPE_CHECKING:
    from server.worker.loop import Worker

STALL_PERIODS = 10  # lease-loop periods without a tick before the worker counts as wedged


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: no access log
        return


class Probes:
    """The worker's state as probes see it; ``worker`` is set once the model is loaded."""

    def __init__(self) -> None:
        self.workers: list[Worker] = []  # one per model this process holds; all must pass
        self._metrics = make_wsgi_app()

    @property
    def worker(self) -> Worker | None:
        return self.workers[0] if self.workers else None

    @worker.setter
    def worker(self, w: Worker | None) -> None:
        self.workers = [w] if w is not None else []

    def live(self) -> tuple[bool, str]:
        if not self.workers:
            return True, "loading the model"
        for w in self.workers:
            ok, why = self._live(w)
            if not ok:
                return ok, why
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        if not self.workers:
            return False, "loading the model"
        for w in self.workers:
            ok, why = self._ready(w)
            if not ok:
                return ok, why
        return True, "ok"

    def _live(self, w: Worker) -> tuple[bool, str]:
        if not w.engine_alive():
            return False, "the engine thread has stopped"
        stalled = time.monotonic() - w.last_tick
        if stalled > STALL_PERIODS * w.lease_period_s:
            return False, f"the event loop has not run the lease loop for {stalled:.0f} s"
        return True, "ok"

    def _ready(self, w: Worker) -> tuple[bool, str]:
        live, why = self._live(w)
        if not live:
            return False, why
        if w.draining:
            return False, "draining"
        if not w.store_ok:
            return False, "Redis is unreachable"
        if w.last_heartbeat is None or time.monotonic() - w.last_heartbeat > w.lease_ttl_s:
            return False, "no heartbeat has reached Redis within the lease TTL"
        return True, "ok"

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path not in ("/healthz", "/readyz", "/metrics"):
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"not found; this port serves /metrics, /healthz and /readyz\n"]
        if environ.get("REQUEST_METHOD") != "GET":
            start_response("405 Method Not Allowed", [("Content-Type", "text/plain"), ("Allow", "GET")])
            return [b"method not allowed; allowed: GET\n"]
        check = {"/healthz": self.live, "/readyz": self.ready}.get(path)
        if check is None:
            result: Iterable[bytes] = self._metrics(environ, start_response)
            return result
        ok, why = check()
        start_response(
            "200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain; charset=utf-8")]
        )
        return [f"{why}\n".encode()]


def serve_probes(port: int, host: str) -> Probes:
    """Start the worker's HTTP port on a daemon thread; returns the probes (set ``.worker`` when ready)."""
    probes = Probes()
    httpd = make_server(host, port, probes, _Server, handler_class=_QuietHandler)
    threading.Thread(target=httpd.serve_forever, name="worker-probes", daemon=True).start()
    return probes
