"""The ``tokenwire`` command."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from server import __version__, argtypes
from server.engine.api import PROMPT_SHARING
from server.logs import FORMATS

if TYPE_CHECKING:
    from server.app import ServeConfig

DEFAULT_URL = "ws://127.0.0.1:8765/v1/ws"


class _Help(argparse.HelpFormatter):
    """Shows each option's default, unless its help already says it or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            not action.option_strings
            or "default" in text
            or action.default in (None, False, argparse.SUPPRESS)
            or not text
        ):
            return action.help
        return text + " (default: %(default)s)"


def _ws_origin(value: str) -> str:
    from server.gateway.ui_config import ws_origin

    try:
        return ws_origin(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(:\d{1,3})?)$")


def _device(value: str) -> str:
    """``--device``: checked here, so a typo is one line at once, not torch's words after the imports."""
    if not DEVICE_RE.match(value):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda, cuda:N or mps, got {value!r}")
    return value


LOG_LEVELS = ("debug", "info", "warning", "error")


def _log_level(value: str) -> str:
    if value.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LOG_LEVELS)}, got {value!r}")
    return value.lower()


def _key_prefix(value: str) -> str:
    """Every key starts with it: on a Redis other programs share, an empty one would mix ours with theirs."""
    if not value:
        raise argparse.ArgumentTypeError("must not be empty (the default is tw:)")
    return value


MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def _model_name(name: str, given: str) -> str:
    if not MODEL_NAME_RE.match(name) or name == "default":
        raise argparse.ArgumentTypeError(
            f"{given!r}: a model name is 1-64 letters, digits, '.', '_' or '-' (not 'default', which "
            "names the default model); write --model NAME=DIR"
        )
    return name


def _model_spec(value: str) -> tuple[str, str]:
    """``--model NAME=DIR`` or ``--model DIR`` (then named after the folder)."""
    from server.app import model_name_for

    name, sep, folder = value.partition("=")
    if not sep or not name or Path(value).is_dir():
        return _model_name(model_name_for(value), value), value
    if not folder:
        raise argparse.ArgumentTypeError(f"{value!r}: expected NAME=DIR, the folder is missing")
    return _model_name(name, value), folder


def _fallback(value: str) -> tuple[str, str]:
    """``--fallback MODEL=LIGHT``."""
    heavy, sep, light = value.partition("=")
    if not sep or not heavy or not light:
        raise argparse.ArgumentTypeError(f"{value!r}: expected MODEL=LIGHT_MODEL (two model names)")
    return _model_name(heavy, value), _model_name(light, value)


def _models(args: argparse.Namespace) -> tuple[tuple[str, str | None], ...]:
    """The --model options, the first the default; none: the packaged model. Two of one name: an error."""
    specs: list[tuple[str, str]] = getattr(args, "model", None) or []
    names = [n for n, _ in specs]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        from server.app import StartupError

        raise StartupError(f"--model: two models named {dup!r}; name them apart with --model NAME=DIR")
    return tuple(specs)


def fallback_warning(args: argparse.Namespace) -> str | None:
    """A --fallback without a trigger never moves a chat (README, Degradation): said at start."""
    if not getattr(args, "fallback", None):
        return None
    if getattr(args, "degrade_queue_depth", 0) or getattr(args, "degrade_ttft", 0.0):
        return None
    if getattr(args, "max_queued", 0):
        return None  # a full queue moves chats to the lighter model too
    return (
        f"tokenwire {args.command}: warning: --fallback moves a chat only past a trigger, and none is set: "
        "add --degrade-queue-depth N (chats waiting for the model), --degrade-ttft S or --max-queued N"
    )


def _config(args: argparse.Namespace) -> ServeConfig:
    from server.app import ServeConfig
    from server.gateway.server import GatewaySettings
    from server.store.requests import Settings

    return ServeConfig(
        gateway=GatewaySettings(
            host=getattr(args, "host", "127.0.0.1"),
            port=getattr(args, "port", 8765),
            auth_secret=getattr(args, "auth_secret", None) or os.environ.get("TOKENWIRE_AUTH_SECRET") or None,
            allowed_origins=tuple(args.allowed_origin) if getattr(args, "allowed_origin", None) else None,
            response_cache=not getattr(args, "no_response_cache", False),
            shared_response_cache=getattr(args, "shared_response_cache", False),
            degrade_queue_depth=getattr(args, "degrade_queue_depth", 0),
            degrade_ttft_s=getattr(args, "degrade_ttft", 0.0),
            degrade_max_tokens=getattr(args, "degrade_max_tokens", 128),
            degrade_context_messages=getattr(args, "degrade_context_messages", 8),
            metrics_port=getattr(args, "metrics_port", None),
            metrics_host=getattr(args, "metrics_host", None),
            ui_connect=tuple(getattr(args, "ui_connect", None) or ()),
            fallbacks=tuple(getattr(args, "fallback", None) or ()),
            max_streams_per_user=getattr(args, "max_streams_per_user", 256),
            chat_bytes_per_connection=getattr(args, "chat_bytes_per_connection", 1 << 20),
            max_waiting_turns_per_session=getattr(args, "max_waiting_turns", 2),
            max_detach_timeout_ms=int(getattr(args, "max_detach_timeout", 600.0) * 1000),
            http_request_timeout_s=getattr(args, "http_request_timeout", 30.0),
            max_http_connections=getattr(args, "max_http_connections", 4096),
            max_http_connections_per_peer=getattr(args, "max_http_connections_per_peer", 256),
            max_ws_connections=getattr(args, "max_ws_connections", 65536),
            max_ws_connections_per_peer=getattr(args, "max_ws_connections_per_peer", 8192),
            ingress_bytes_per_peer=getattr(args, "ingress_bytes_per_peer", 16 << 20),
        ),
        store=Settings(
            lease_ttl_ms=int(args.lease_ttl * 1000),
            detach_timeout_ms=int(getattr(args, "detach_timeout", 30.0) * 1000),
            retention_ms=max(1, int(getattr(args, "retention", 24 * 3600.0) * 1000)),
            max_queued=getattr(args, "max_queued", 0),
            max_inflight_per_user=getattr(args, "max_inflight_per_user", 0),
            session_ttl_ms=max(1, int(getattr(args, "session_ttl", 24 * 3600.0) * 1000)),
            history_max_messages=max(2, getattr(args, "history_max_messages", 64)),
            history_max_bytes=max(1, getattr(args, "history_max_bytes", 1 << 20)),
        ),
        redis_url=args.redis_url or os.environ.get("TOKENWIRE_REDIS_URL") or None,
        data_dir=Path(getattr(args, "data_dir", None) or os.environ.get("TOKENWIRE_DATA") or ".tokenwire"),
        key_prefix=args.key_prefix,
        models=_models(args),
        device=getattr(args, "device", None),
        dtype=getattr(args, "dtype", "auto"),
        threads=getattr(args, "threads", None),
        scheduling=getattr(args, "scheduling", "fair"),
        kv_budget_mb=getattr(args, "kv_budget_mb", None),
        prompt_sharing=getattr(args, "prompt_sharing", "public"),
        drain_timeout_s=getattr(args, "drain_timeout", 10.0),
        log_flush_ms=getattr(args, "log_flush_ms", 0.0),
        session_secret=os.environ.get("TOKENWIRE_SESSION_SECRET") or None,
        name=getattr(args, "name", None),
        metrics_port=getattr(args, "metrics_port", None),
    )


def _run(args: argparse.Namespace, main: Callable[[ServeConfig], Coroutine[Any, Any, None]]) -> int:
    from server import app
    from server.aio import left_running
    from server.app import StartupError
    from server.logs import configure

    # A cluster's child is told its name (server/cluster.py), so its JSON lines say whose they are.
    configure(args.log_level, fmt=args.log_format, process=os.environ.get("TOKENWIRE_LOG_PROCESS"))
    warning = fallback_warning(args)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    try:
        cfg = _config(args)
        if cfg.redis_url is not None and (problem := argtypes.redis_url_problem(cfg.redis_url)) is not None:
            raise StartupError(f"$TOKENWIRE_REDIS_URL: {problem}")
        asyncio.run(main(cfg))
    except KeyboardInterrupt:
        return 130  # Ctrl-C before the signal handlers were up (while importing or loading)
    except StartupError as exc:
        # Something the user can fix (a port in use, Redis unreachable, no model): one line, no traceback.
        print(f"tokenwire {args.command}: {exc}", file=sys.stderr, flush=True)
        return 2
    rc = 130 if app.stopped_by == signal.SIGINT else 0
    if left_running():
        # Stopped while a model loaded: everything of ours is closed, but the load's thread is still in
        # torch, and the interpreter's exit would abort under it (aio.left_running).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


def _serve(args: argparse.Namespace) -> int:
    from server.app import serve

    return _run(args, serve)


def _gateway(args: argparse.Namespace) -> int:
    from server.app import run_gateway

    return _run(args, run_gateway)


def _worker(args: argparse.Namespace) -> int:
    from server.app import run_worker

    return _run(args, run_worker)


def _cluster(args: argparse.Namespace) -> int:
    from server.cluster import run_cluster

    return run_cluster(args)


def _chat(args: argparse.Namespace) -> int:
    from server.chat_cli import check_url, run_chat

    problem = check_url(args.url)
    if problem is not None:
        print(f"tokenwire chat: {problem}", file=sys.stderr)
        return 2
    return asyncio.run(
        run_chat(
            args.url,
            token=args.token,
            once=args.message,
            temperature=args.temperature,
            max_tokens=args.max_tokens,
            model=args.model,
        )
    )


def _bench(args: argparse.Namespace) -> int:
    from server.bench.main import main
    from server.bench.paths import PATHS

    paths = args.paths.split(",") if args.paths else PATHS
    results = main(
        json_path=args.json,
        turns=args.turns,
        device=args.device,
        random_weights=args.random_weights,
        requests=args.requests,
        seed=args.seed,
        model=args.model,
        dtype=args.dtype,
        paths=paths,
        profile=args.profile,
    )
    return 1 if results["failed"] else 0


def _load(args: argparse.Namespace) -> int:
    from server.load.cli import run_from_args

    return run_from_args(args)


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    if raw[:1] == ["eval"]:
        from server.eval.cli import main as evaluate

        return evaluate(raw[1:])
    if raw[:1] == ["capacity"]:
        from server.load.capacity import main as capacity

        return capacity(raw[1:])
    args = build_parser().parse_args(argv)
    rc: int = args.func(args)
    return rc


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand's options (``eval`` and ``capacity`` parse their own: listed here, parsed there)."""
    p = argparse.ArgumentParser(prog="tokenwire", description="WebSocket chat server for LLMs")
    p.add_argument("--version", action="version", version=f"tokenwire {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def store_flags(p: argparse.ArgumentParser) -> None:
        """How long the store keeps what (every process of a cluster passes them on alike)."""
        p.add_argument(
            "--lease-ttl",
            type=argtypes.positive_seconds,
            default=10.0,
            help="worker lease, seconds (default 10)",
        )
        p.add_argument(
            "--retention",
            type=argtypes.positive_seconds,
            default=24 * 3600.0,
            help="keep a finished request and its token log (for resume and retries) this long, seconds",
        )
        p.add_argument(
            "--session-ttl",
            type=argtypes.positive_seconds,
            default=24 * 3600.0,
            help="keep an idle session and its history this long after its last use, seconds (default 1 day)",
        )
        p.add_argument(
            "--history-max-messages",
            type=argtypes.at_least_one,
            default=64,
            help="a session's history keeps at most this many messages; the oldest turns go first",
        )
        p.add_argument(
            "--history-max-bytes",
            type=argtypes.at_least_one,
            default=1 << 20,
            help="and at most this many bytes (the newest turn always stays; default 1 MiB)",
        )

    def logging_flags(p: argparse.ArgumentParser) -> None:
        p.add_argument("--log-level", type=_log_level, default="info", help="debug, info, warning or error")
        p.add_argument(
            "--log-format",
            choices=FORMATS,
            help="stderr's logs: console (readable lines), json (JSON lines) or auto: console on a "
            "terminal, json otherwise (default: $TOKENWIRE_LOG_FORMAT, else auto; server/logs.py)",
        )

    def common(p: argparse.ArgumentParser, *, redis_required: bool) -> None:
        p.add_argument(
            "--redis-url",
            required=False,
            type=argtypes.redis_url,
            help="Redis/Valkey URL (or $TOKENWIRE_REDIS_URL)"
            + ("; required" if redis_required else "; default: start an embedded Valkey"),
        )
        p.add_argument(
            "--key-prefix", type=_key_prefix, default="tw:", help="prefix of every Redis key (default tw:)"
        )
        p.add_argument("--name", help="this process's id in the store (default host-pid)")
        store_flags(p)
        logging_flags(p)

    def sockets(p: argparse.ArgumentParser) -> None:
        p.add_argument("--host", default="127.0.0.1", help="address to listen on")
        p.add_argument(
            "--port", type=argtypes.port, default=8765, help="0 picks a free port (printed on stdout)"
        )
        p.add_argument(
            "--detach-timeout",
            type=argtypes.positive_seconds,
            default=30.0,
            help="cancel a request nobody is attached to for this long, seconds (default 30)",
        )
        p.add_argument(
            "--max-detach-timeout",
            type=argtypes.positive_seconds,
            default=600.0,
            help="the longest a chat's params.detach_timeout_ms may ask to keep it running with nobody "
            "attached (an app in the background), seconds (default 600; welcome.limits); such requests "
            "hold their place that long, so bound them with --max-inflight-per-user on a public server",
        )
        p.add_argument(
            "--max-queued",
            type=argtypes.count,
            default=0,
            help="refuse new chats with `overloaded` while this many wait in the queue (0: no limit)",
        )
        p.add_argument(
            "--max-inflight-per-user",
            type=argtypes.count,
            default=0,
            help="refuse a user's new chats with `rate_limited` while they have this many queued or running, "
            "across all gateways (0: no limit)",
        )
        p.add_argument(
            "--auth-secret",
            help="require hello.token: an HS256 JWT signed with this secret (or $TOKENWIRE_AUTH_SECRET)",
        )
        a = p.add_argument_group("admission (SPEC.md §6, §15.2): limits every door applies")
        a.add_argument(
            "--max-streams-per-user",
            type=argtypes.at_least_one,
            default=256,
            help="streams one user may have attached to this gateway at once (default 256)",
        )
        a.add_argument(
            "--chat-bytes-per-connection",
            type=argtypes.at_least_one,
            default=1 << 20,
            help="bytes of chat text per second per connection (HTTP: per user), bursts of twice that "
            "(default 1 MiB)",
        )
        a.add_argument(
            "--max-waiting-turns",
            type=argtypes.count,
            default=2,
            help="content-mode turns of one session that may wait for the previous turn (default 2)",
        )
        a.add_argument(
            "--http-request-timeout",
            type=argtypes.positive_seconds,
            default=30.0,
            help="an HTTP request's headers and body must arrive within this, seconds (default 30)",
        )
        a.add_argument(
            "--max-http-connections",
            type=argtypes.at_least_one,
            default=4096,
            help="HTTP connections this gateway holds at once (default 4096; past it: 503)",
        )
        a.add_argument(
            "--max-http-connections-per-peer",
            type=argtypes.at_least_one,
            default=256,
            help="HTTP connections from one peer address (default 256; past it: 429)",
        )
        a.add_argument(
            "--max-ws-connections",
            type=argtypes.at_least_one,
            default=65536,
            help="WebSockets this gateway holds at once, both doors (default 65536; past it: 503)",
        )
        a.add_argument(
            "--max-ws-connections-per-peer",
            type=argtypes.count,
            default=8192,
            help="WebSockets from one peer address (default 8192; past it: 429; 0: no per-peer cap, "
            "for a gateway behind a proxy)",
        )
        a.add_argument(
            "--ingress-bytes-per-peer",
            type=argtypes.count,
            default=16 << 20,
            help="bytes a second read from all connections of one peer address together (default 16 MiB; "
            "0: off, e.g. behind a reverse proxy, where every client has its address)",
        )
        d = p.add_argument_group("degradation under load (0 = off)")
        d.add_argument(
            "--degrade-queue-depth", type=argtypes.count, default=0, help="degrade new chats past this queue"
        )
        d.add_argument(
            "--degrade-ttft", type=argtypes.seconds, default=0.0, help="... or past this TTFT (seconds)"
        )
        d.add_argument(
            "--degrade-max-tokens",
            type=argtypes.at_least_one,
            default=128,
            help="max_tokens cap when degraded",
        )
        d.add_argument(
            "--degrade-context-messages",
            type=argtypes.at_least_one,
            default=8,
            help="latest messages kept when degraded",
        )
        d.add_argument(
            "--fallback",
            action="append",
            type=_fallback,
            metavar="MODEL=LIGHT",
            help="past a threshold, send MODEL's new chats to the lighter LIGHT (both served models; "
            "repeat for several); a chat with params.fallback false stays",
        )
        p.add_argument(
            "--no-response-cache",
            action="store_true",
            help="never answer repeated deterministic chats (temperature 0 or a fixed seed) from the cache",
        )
        p.add_argument(
            "--shared-response-cache",
            action="store_true",
            help="one response cache for all users (default: one per user). A side channel: a user whose "
            "chat is answered at once learns that someone else asked the same recently",
        )
        p.add_argument(
            "--metrics-port",
            type=argtypes.port,
            help="serve Prometheus /metrics on this port (0: a free one) and not on --port; without it "
            "/metrics is on --port, and only while auth is off",
        )
        p.add_argument("--metrics-host", help="address for --metrics-port (default: --host)")
        p.add_argument(
            "--ui-connect",
            action="append",
            type=_ws_origin,
            metavar="ORIGIN",
            help="a WebSocket origin (wss://host[:port]) the browser UI may connect to with ?ws= besides "
            "this server (repeat; default: none). Listed in /config.json and the page's CSP",
        )
        p.add_argument(
            "--allowed-origin",
            action="append",
            help="a browser Origin allowed to connect (repeat; default: any). Clients without Origin pass.",
        )

    def model(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--model",
            action="append",
            type=_model_spec,
            metavar="NAME=DIR",
            help="a model to serve: NAME=DIR, or DIR (named after the folder), DIR a Hugging Face causal-LM "
            "folder; repeat for several, the first is the default (default: the packaged "
            "SmolLM2-135M-Instruct, named so)",
        )
        p.add_argument(
            "--device", type=_device, default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ..."
        )
        p.add_argument(
            "--dtype", choices=DTYPES, default="auto", help="auto (CUDA: bf16; CPU: measured), float32, ..."
        )
        p.add_argument(
            "--threads",
            type=argtypes.at_least_one,
            help="torch CPU threads for the engine (default: torch's)",
        )
        p.add_argument(
            "--scheduling",
            choices=("fair", "fifo"),
            default="fair",
            help="engine admission: fair (token-weighted fair queueing per user) or fifo",
        )
        p.add_argument(
            "--kv-budget-mb",
            type=argtypes.at_least_one,
            metavar="MB",
            help="memory for the KV cache, MiB (default: on CPU 1024 or an eighth of RAM if less; on CUDA "
            "half the free GPU memory, at most 32 GiB). Fewer MiB, fewer sequences at once",
        )
        p.add_argument(
            "--prompt-sharing",
            choices=PROMPT_SHARING,
            default="public",
            help="which requests may reuse each other's prompt start (its KV copied, not computed again): "
            "public (default): across users only the chat template's own opening, any common start "
            "within one user's requests; tenant: any common start across users too, for a deployment "
            "whose callers are one tenant (one caller can then time whether another's prompt starts like "
            "theirs); off: none",
        )
        p.add_argument(
            "--drain-timeout",
            type=argtypes.seconds,
            default=10.0,
            help="on SIGTERM, let running requests finish this long before handing them back (seconds)",
        )
        p.add_argument(
            "--log-flush-ms",
            type=argtypes.flush_ms,
            default=0.0,
            metavar="MS",
            help="write the token logs to Redis at most this often: several steps' tokens of a reply in one "
            "entry, fewer Redis commands and bytes per token, each token later by up to MS "
            "(default 0: after every engine step)",
        )

    s = sub.add_parser(
        "serve", help="gateway + worker in one process (embedded Valkey by default)", formatter_class=_Help
    )
    common(s, redis_required=False)
    sockets(s)
    model(s)
    s.add_argument("--data-dir", help="embedded Valkey data (default $TOKENWIRE_DATA or ./.tokenwire)")
    s.set_defaults(func=_serve)

    g = sub.add_parser(
        "gateway", help="a gateway process: WebSockets, no model (cluster mode)", formatter_class=_Help
    )
    common(g, redis_required=True)
    sockets(g)
    g.set_defaults(func=_gateway)

    w = sub.add_parser(
        "worker", help="a worker process: the model, no sockets (cluster mode)", formatter_class=_Help
    )
    common(w, redis_required=True)
    model(w)
    w.add_argument(
        "--metrics-port",
        type=argtypes.port,
        help="serve Prometheus /metrics and the /healthz (liveness) and /readyz (readiness) probes here",
    )
    w.add_argument("--host", default="127.0.0.1", help="address for --metrics-port")
    w.set_defaults(func=_worker)

    k = sub.add_parser(
        "cluster", help="a local cluster: N gateways and M workers sharing one Redis", formatter_class=_Help
    )
    k.add_argument("--gateways", type=argtypes.at_least_one, default=2, help="gateway processes")
    k.add_argument("--workers", type=argtypes.at_least_one, default=2, help="worker processes")
    k.add_argument("--host", default="127.0.0.1", help="address the gateways listen on")
    k.add_argument("--port", type=argtypes.port, default=8765, help="first gateway's port; the others follow")
    k.add_argument(
        "--redis-url", type=argtypes.redis_url, help="shared Redis (default: start an embedded Valkey)"
    )
    k.add_argument(
        "--redis-shards",
        type=int,
        default=0,
        help="instead of one embedded Valkey, start a local Valkey cluster of this many masters (a demo of "
        "cluster mode: TCP ports on 127.0.0.1 with a random password, data in a temporary folder that goes "
        "when it stops)",
    )
    k.add_argument("--data-dir", help="embedded Valkey data (default $TOKENWIRE_DATA or ./.tokenwire)")
    k.add_argument("--key-prefix", type=_key_prefix, default="tw:", help="prefix of every Redis key")
    k.add_argument(
        "--prompt-sharing",
        choices=PROMPT_SHARING,
        default="public",
        help="the workers' --prompt-sharing (see tokenwire worker --help)",
    )
    k.add_argument(
        "--model",
        action="append",
        metavar="NAME=DIR",
        help="a model every worker serves: NAME=DIR or DIR; repeat for several, the first the default "
        "(default: the packaged SmolLM2-135M)",
    )
    k.add_argument(
        "--drain-timeout",
        type=argtypes.seconds,
        default=10.0,
        help="on SIGTERM or Ctrl-C, the workers let running requests finish this long before handing them "
        "back (seconds; a second signal stops at once)",
    )
    k.add_argument(
        "--threads-per-worker",
        type=argtypes.at_least_one,
        default=1,
        help="torch threads per worker (default 1)",
    )
    k.add_argument(
        "--log-flush-ms",
        type=argtypes.flush_ms,
        default=0.0,
        metavar="MS",
        help="each worker's --log-flush-ms (default 0)",
    )
    k.add_argument(
        "--pin-workers",
        action="store_true",
        help="pin worker i to CPU i (round robin over this process's CPUs), as taskset would: each "
        "worker then uses one core whatever its threads; gateways and Redis are left unpinned",
    )
    store_flags(k)
    logging_flags(k)
    k.set_defaults(func=_cluster)

    c = sub.add_parser("chat", help="chat in the terminal with a running server", formatter_class=_Help)
    c.add_argument(
        "url", nargs="?", default=DEFAULT_URL, help=f"the server's WebSocket URL (default {DEFAULT_URL})"
    )
    c.add_argument("--token", help="JWT for servers with auth on")
    c.add_argument("-m", "--message", help="ask one question, print the streamed answer, exit")
    c.add_argument(
        "--temperature",
        type=argtypes.temperature,
        help="sampling temperature, 0 to 2 (default: the server's, 0: greedy)",
    )
    c.add_argument(
        "--max-tokens",
        type=argtypes.max_tokens,
        help="longest reply in tokens, 1 to 8192 (default: the server's, 256)",
    )
    c.add_argument("--model", help="one of the server's models (default: the server's default model)")
    c.set_defaults(func=_chat)

    b = sub.add_parser(
        "bench", help="engine throughput and latency against transformers baselines", formatter_class=_Help
    )
    b.add_argument("--json", metavar="FILE", help="write the results as JSON")
    b.add_argument("--turns", type=int, default=0, help="also measure TTFT per turn of an N-turn session")
    b.add_argument("--device", type=_device, default="auto", help="auto (cuda if available), cpu, cuda, ...")
    b.add_argument(
        "--random-weights", metavar="CONFIG", help="random Llama: 1b, 1.7b, 135m, tiny or a config.json"
    )
    b.add_argument("--requests", type=int, default=32, help="concurrent requests per path")
    b.add_argument("--seed", type=int, default=0, help="seed of the prompts and sampling")
    b.add_argument("--model", help="a Hugging Face causal-LM folder (default: the packaged SmolLM2-135M)")
    b.add_argument(
        "--dtype", choices=DTYPES, default="auto", help="auto (CUDA: bf16; CPU: measured), float32, ..."
    )
    b.add_argument("--paths", help="comma-separated subset of padded_loop,static,hf_cb,engine,engine_poisson")
    b.add_argument("--profile", action="store_true", help="break a decode step down by phase")
    b.set_defaults(func=_bench)

    from server.load.options import add_arguments as add_load_arguments

    ld = sub.add_parser("load", help="WebSocket load test of a running server (latency, tokens/s, resumes)")
    add_load_arguments(ld)
    ld.set_defaults(func=_load)

    # Their own parsers (server/load/capacity.py, server/eval/cli.py): listed here, parsed there.
    sub.add_parser(
        "capacity",
        help="size gateways, workers and Redis shards for a load, from make bench's measured unit costs",
        add_help=False,
    )

    sub.add_parser(
        "eval",
        help="score sampling settings on about 40 checked prompts with the real model; choose the defaults",
        add_help=False,
    )
    return p


if __name__ == "__main__":
    sys.exit(main())
