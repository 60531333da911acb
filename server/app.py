"""The three ways to run: ``serve`` (gateway + worker in one process, embedded Valkey by default),
``gateway`` (sockets, no model) and ``worker`` (model, no sockets). All use the same store code, so
resume, retries and cancel take one code path everywhere."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.asyncio.cluster import RedisCluster

from server.aio import cancel_and_wait, in_daemon_thread
from server.cluster import SECOND_SIGNAL_ENV
from server.gateway.server import WS_PATH, BindFailed, Gateway, GatewaySettings
from server.gctune import tune_for_long_lived_objects
from server.malloctune import keep_freed_memory_for_the_engine, return_freed_memory_to_the_os, trim_heap
from server.store.keys import CLUSTER_PARTITIONS, Keys
from server.store.requests import RequestStore, Settings
from server.store.sessions import SessionStore, shared_secret

log = structlog.get_logger(__name__)


class StartupError(Exception):
    """A process cannot start for a reason the user can fix; the CLI prints the message as one line and
    exits non-zero (no traceback)."""


@dataclass(slots=True)
class ServeConfig:
    gateway: GatewaySettings = field(default_factory=GatewaySettings)
    store: Settings = field(default_factory=Settings)
    redis_url: str | None = None
    data_dir: Path = Path(".tokenwire")
    key_prefix: str = "tw:"
    model: str | None = None  # one model's folder (None: the packaged default); see ``models``
    # Several models: (name, folder or None for the packaged default), the deployment's default first.
    # Empty: just ``model``, named after its folder (or the packaged model's name).
    models: tuple[tuple[str, str | None], ...] = ()
    device: str | None = None
    dtype: str = "auto"
    threads: int | None = None  # torch CPU threads for the engine (None: torch's default)
    scheduling: str = "fair"  # engine admission: "fair" (token-weighted fair queueing per user) or "fifo"
    kv_budget_mb: int | None = None  # the engine's KV cache memory (None: its default for the device)
    prompt_sharing: str = "public"  # which sequences copy each other's prompt starts (engine.PROMPT_SHARING)
    session_secret: str | None = None
    max_running: int = 64
    log_flush_ms: float = 0.0  # the worker writes token logs at most this often (0: every step)
    drain_timeout_s: float = 10.0
    name: str | None = None  # worker/gateway id (default host-pid)
    metrics_port: int | None = None  # a worker's /metrics, /healthz, /readyz (gateways: their own port)


def model_specs(cfg: ServeConfig) -> tuple[tuple[str, str | None], ...]:
    """The models to serve, (name, folder), the default first."""
    if cfg.models:
        return cfg.models
    return ((model_name_for(cfg.model), cfg.model),)


def model_name_for(folder: str | None) -> str:
    """The name a model gets when the command line gives none: its folder's name, or the packaged one's."""
    from server.engine.model import DEFAULT_MODEL_NAME

    return Path(folder).resolve().name if folder else DEFAULT_MODEL_NAME


@dataclass(slots=True)
class StoreHandles:
    r: aioredis.Redis
    reader: aioredis.Redis  # its own client: the log reader's blocking XREAD holds a connection
    store: RequestStore
    url: str


# The signal that stopped this process, if one did: `tokenwire` exits 130 after a SIGINT (Ctrl-C), as
# shells expect of a program the user interrupted, and 0 after a SIGTERM (a supervisor's normal stop).
stopped_by: int | None = None


# The embedded Valkey of this process, if it started one: a forced exit stops it too (it runs in a
# session of its own, so no signal of the terminal's reaches it).
_embedded: list[Any] = []


def _stop_on_signals(stop: asyncio.Event) -> None:
    """The first SIGINT or SIGTERM stops gracefully (drain, 1012 to clients); a second one, while that
    runs, exits at once: what was running is handed back when the worker's lease lapses, or resumed
    from the store after a restart. Not in a child of `tokenwire cluster`: a terminal's Ctrl-C reaches
    it and the cluster, whose SIGTERM then follows; the cluster kills its children on a second signal."""
    loop = asyncio.get_running_loop()

    parent_decides = os.environ.get(SECOND_SIGNAL_ENV) == "parent"  # a child of `tokenwire cluster`

    def on_signal(sig: int) -> None:
        global stopped_by
        if stop.is_set() and not parent_decides:
            log.warning("stop.forced", signal=signal.Signals(sig).name)
            for valkey in _embedded:
                with contextlib.suppress(Exception):
                    valkey.stop(timeout=2.0)
            os._exit(130 if sig == signal.SIGINT else 143)
        stopped_by = stopped_by or sig
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, on_signal, sig)


async def is_cluster(r: aioredis.Redis) -> bool:
    """Whether ``r`` is a Redis Cluster (or Valkey cluster) node: ``INFO cluster`` says
    ``cluster_enabled:1``. No flag: the URL of any node is enough."""
    info = await r.info("cluster")
    return bool(int(info.get("cluster_enabled", 0)))


@contextlib.asynccontextmanager
async def open_store(cfg: ServeConfig, *, embedded_ok: bool) -> AsyncIterator[StoreHandles]:
    """Connect to ``cfg.redis_url``, or start the embedded Valkey when allowed and none is given."""
    from server.store.embedded import EmbeddedValkey, EmbeddedValkeyError

    valkey: EmbeddedValkey | None = None
    url = cfg.redis_url
    if url is None:
        if not embedded_ok:
            raise StartupError("--redis-url is required here (gateways and workers share one Redis)")
        valkey = EmbeddedValkey(cfg.data_dir)
        try:
            url = await asyncio.get_running_loop().run_in_executor(None, valkey.start)
        except EmbeddedValkeyError as exc:
            raise StartupError(str(exc)) from None
        _embedded.append(valkey)
    # A blocking pool: a burst of thousands of handshakes waits for a connection instead of failing with
    # "Too many connections" (redis-py's default pool raises past 100).
    # from_pool: the client owns the pool, so closing it closes the pool's connections too. The URL may
    # be redis://[user:password@]host, rediss:// (TLS) or unix://path (the embedded Valkey).
    r: Any = aioredis.Redis.from_pool(
        aioredis.BlockingConnectionPool.from_url(url, max_connections=64, timeout=30)
    )
    reader: Any = aioredis.from_url(url)
    try:
        try:
            await asyncio.wait_for(r.ping(), 10)
            cluster = await is_cluster(r)
        except (aioredis.RedisError, OSError, TimeoutError) as exc:
            where = "the embedded Valkey" if valkey is not None else f"Redis at {_redacted(url)}"
            raise StartupError(
                f"cannot reach {where}: {str(exc) or type(exc).__name__}. "
                "Start it, or pass the right --redis-url"
            ) from None
        keys = Keys(cfg.key_prefix)
        if cluster:
            # A Redis Cluster: redis-py's cluster client (it follows MOVED/ASK and routes each command by
            # its keys' slot), and the work queue in CLUSTER_PARTITIONS partitions (server/store/keys.py).
            await r.aclose()
            await reader.aclose()
            r = RedisCluster.from_url(url)
            reader = RedisCluster.from_url(url)
            try:
                keys = Keys(cfg.key_prefix, CLUSTER_PARTITIONS)
            except ValueError as exc:
                raise StartupError(str(exc)) from None
            log.info("store.cluster", nodes=len(await r.cluster_nodes()), partitions=keys.partitions)
        store = RequestStore(r, keys, cfg.store)
        # Every script loaded before the process says ready: a cluster pipeline does not load them itself,
        # and elsewhere the first calls under load would each pay a NOSCRIPT round trip and a SCRIPT LOAD
        # of every script (what the store-cost benchmark saw as ~50 KB of script text in its load phase).
        await store.load_scripts()
        yield StoreHandles(r, reader, store, url)
    finally:
        await r.aclose()
        await reader.aclose()
        if valkey is not None:
            valkey.stop()
            _embedded.remove(valkey)


def _redacted(url: str) -> str:
    """``url`` without its password (it may be printed)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def bind_error(host: str, port: int, exc: OSError, flag: str = "--port") -> StartupError:
    """The one line a user sees when a port cannot be bound, naming the flag that set it and the fix."""
    if exc.errno == errno.EADDRINUSE:
        why = "is already in use (another tokenwire?)"
    elif exc.errno == errno.EACCES:
        why = "needs privileges to bind"
    else:
        why = f"cannot be bound ({exc.strerror or exc})"
    if flag != "--port":
        return StartupError(f"{flag} {port} on {host} {why}: choose another with {flag} N")
    return StartupError(
        f"port {port} on {host} {why}: choose another with --port N (0 picks a free one), "
        "or `make run PORT=N`"
    )


def check_model(model: str | None) -> None:
    """Fail before listening when the model cannot be found (loading it takes seconds, after listening)."""
    from server.engine.model import ModelNotFound, check_model_source

    try:
        check_model_source(model)
    except ModelNotFound as exc:
        raise StartupError(str(exc)) from None


def check_models(cfg: ServeConfig) -> None:
    """Every model folder exists, and every --fallback names two of the served models."""
    specs = model_specs(cfg)
    for _name, folder in specs:
        check_model(folder)
    names = [name for name, _ in specs]
    for heavy, light in cfg.gateway.fallbacks:
        for n in (heavy, light):
            if n not in names:
                raise StartupError(
                    f"--fallback {heavy}={light}: {n!r} is not a served model ({', '.join(names)})"
                )


async def start_gateway(cfg: ServeConfig, h: StoreHandles, ready: Any) -> Gateway:
    secret = await shared_secret(h.r, h.store.keys, cfg.session_secret)
    sessions = SessionStore(h.r, h.store.keys, secret, cfg.store.session_ttl_ms)
    gateway = Gateway(h.store, sessions, h.reader, cfg.gateway, ready=ready, name=cfg.name)
    try:
        port = await gateway.start()
    except BindFailed as exc:
        raise bind_error(exc.host, exc.port, exc, exc.flag) from None
    except OSError as exc:
        raise bind_error(cfg.gateway.host, cfg.gateway.port, exc) from None
    tune_for_long_lived_objects()
    # The line tests and scripts wait for; stdout, unbuffered.
    if gateway.metrics_server is not None:
        print(f"tokenwire metrics on {gateway.metrics_server.url}", flush=True)
    print(f"tokenwire listening on ws://{cfg.gateway.host}:{port}{WS_PATH}", flush=True)
    return gateway


def use_threads(threads: int | None) -> None:
    """torch's CPU threads for the engine (None: torch's default). Called before the model loads."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def load_engine(
    model: str | None,
    *,
    device: str | None = None,
    dtype: str = "auto",
    scheduling: str = "fair",
    kv_budget_mb: int | None = None,
    prompt_sharing: str = "public",
) -> tuple[Any, Any]:
    """Load the model and build its engine (the one place that picks the engine implementation):
    ``(loaded model, engine not yet started)``. Blocking: seconds. The work runs in a thread that ends,
    so that the engine's thread is the only one holding an OpenMP pool (server/engine/threads.py)."""
    from server.engine.engine import engine_for
    from server.engine.model import load_model
    from server.engine.threads import in_own_thread

    def load() -> tuple[Any, Any]:
        # lite: no transformers modeling code in a serving process (90 MiB; engine/lite.py).
        loaded = load_model(model, device=device, dtype=dtype, lite=True)
        overrides: dict[str, Any] = {"prompt_sharing": prompt_sharing}
        if kv_budget_mb:
            overrides["kv_budget_mb"] = kv_budget_mb
        # Batching for Llama-family models, SimpleEngine for the rest. Serving keeps one copy of the
        # weights.
        engine = engine_for(loaded, fair=scheduling != "fifo", one_copy=True, **overrides)
        return loaded, engine

    loaded, engine = in_own_thread(load, "tokenwire-load")
    trim_heap()  # the start's temporaries (GGUF conversion, the dtype measurement) back to the OS
    keep_freed_memory_for_the_engine()
    return loaded, engine


async def start_worker(cfg: ServeConfig, h: StoreHandles, index: int = 0) -> Any:
    """Load model ``index`` of ``model_specs(cfg)`` and start a worker for it: one engine, one lease,
    taking only that model's queue (the first model's is the default queue, route "")."""
    from server.worker.loop import Worker

    name, folder = model_specs(cfg)[index]
    use_threads(cfg.threads)
    # Not the default executor: asyncio.run would join its thread, so a stop during the load would wait
    # for the load to end (15 s and more) before the process could exit.
    loaded, engine = await in_daemon_thread(
        lambda: load_engine(
            folder,
            device=cfg.device,
            dtype=cfg.dtype,
            scheduling=cfg.scheduling,
            kv_budget_mb=cfg.kv_budget_mb,
            prompt_sharing=cfg.prompt_sharing,
        ),
        "tokenwire-start-worker",
    )
    loaded.name = name
    base = cfg.name or f"{socket.gethostname()}-{os.getpid()}"
    worker = Worker(
        h.store,
        engine,
        name=base if index == 0 else f"{base}:{name}",  # one lease per model
        max_running=cfg.max_running,
        log_flush_ms=cfg.log_flush_ms,
        model_name=name,
        route="" if index == 0 else name,
    )
    await worker.start()
    print(
        f"tokenwire ready: model {name} on {loaded.device} in {loaded.dtype_name} (worker {worker.name})",
        flush=True,
    )
    return worker


async def start_workers(cfg: ServeConfig, h: StoreHandles, workers: list[Any] | None = None) -> list[Any]:
    """A worker per model, loaded one after another (the default model first), appended to ``workers``
    (a new list if None) as each starts, so the caller sees them before all have. If one fails to start,
    those already started are stopped. Cancelled (a stop while a later model loads), those already
    started stay in ``workers``, running, for the caller to drain: they may be serving already."""
    workers = [] if workers is None else workers
    try:
        for i in range(len(model_specs(cfg))):
            workers.append(await start_worker(cfg, h, i))
    except Exception:
        for w in workers:
            with contextlib.suppress(Exception):
                await w.stop()
        raise
    return workers


async def serve(cfg: ServeConfig, *, stop: asyncio.Event | None = None) -> None:
    """Gateway and worker in one process, until ``stop`` is set (or SIGINT/SIGTERM)."""
    stop = stop or asyncio.Event()
    _stop_on_signals(stop)
    check_models(cfg)
    specs = model_specs(cfg)
    async with open_store(cfg, embedded_ok=True) as h:
        workers: list[Any] = []
        # Ready once the workers are up, and not while they cannot reach Redis (they take no work then).
        gateway = await start_gateway(
            cfg, h, ready=lambda: bool(workers) and all(w.store_ok for w in workers)
        )
        # This process knows its models before loading them: chats may name them at once (they queue).
        gateway.models.local = tuple(name for name, _ in specs)
        gateway.model_name = specs[0][0]
        # welcome.loading names the models whose worker has not started yet (their chats queue).
        started: list[Any] = []
        gateway.models.started = lambda: [w.model_name for w in started]
        worker_task = asyncio.create_task(start_workers(cfg, h, started))
        stop_task = asyncio.create_task(stop.wait())
        try:
            done, _ = await asyncio.wait({worker_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
            if worker_task in done:
                if worker_task.exception() is not None:
                    raise StartupError(f"cannot start the worker: {worker_task.exception()}")
                workers.extend(worker_task.result())
            await stop.wait()
        finally:
            log.info("serve.stopping")
            stop_task.cancel()
            await cancel_and_wait([worker_task])  # a load under way is left to its thread
            await gateway.stop()  # clients get 1012 and will resume
            # Every worker started, also those of a load cut short (``started``: the same objects).
            await asyncio.gather(*(w.drain(cfg.drain_timeout_s) for w in started))


async def run_gateway(cfg: ServeConfig, *, stop: asyncio.Event | None = None) -> None:
    """A gateway process: sockets and sessions, no model. SIGTERM: stop accepting, close with 1012, exit."""
    stop = stop or asyncio.Event()
    _stop_on_signals(stop)
    return_freed_memory_to_the_os()  # no engine here to pay for it (its docstring says why serve does not)
    async with open_store(cfg, embedded_ok=False) as h:

        def ready() -> bool:
            return True  # requests queue until some worker takes them; the gateway checks its store

        gateway = await start_gateway(cfg, h, ready)
        try:
            await stop.wait()
        finally:
            log.info("gateway.draining", connections=len(gateway.connections))
            await gateway.stop()


async def run_worker(cfg: ServeConfig, *, stop: asyncio.Event | None = None) -> None:
    """A worker process: model, no sockets. SIGTERM: take no new work, finish or hand back within
    ``drain_timeout_s``, exit."""
    stop = stop or asyncio.Event()
    _stop_on_signals(stop)
    check_models(cfg)
    async with open_store(cfg, embedded_ok=False) as h:
        probes = None
        if cfg.metrics_port is not None:
            from server.worker.probes import serve_probes

            try:
                probes = serve_probes(cfg.metrics_port, cfg.gateway.host)
            except OSError as exc:
                raise bind_error(cfg.gateway.host, cfg.metrics_port, exc, "--metrics-port") from None
        workers: list[Any] = []
        loading = asyncio.create_task(start_workers(cfg, h, workers))
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
        try:
            if loading.done():
                stopping.cancel()
                loading.result()  # a failed start raises here
                if probes is not None:
                    probes.workers = workers  # ready once every model is
                await stop.wait()
        finally:
            # Stopped while a model loads: the load is left to its thread (nothing waits for it), and
            # the models already started, if any, drain as always.
            await cancel_and_wait([loading, stopping])
            handed = await asyncio.gather(*(w.drain(cfg.drain_timeout_s) for w in workers))
            log.info("worker.stopped", handed_back=sum(handed))
