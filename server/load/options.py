"""What one load run does: the configuration, length distributions, and the ``tokenwire load`` flags.

Kept free of asyncio, rich and matplotlib: ``server.cli`` imports it to build its parser on every command.
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass
from pathlib import Path

from server import argtypes

DEFAULT_DURATION_S = 30.0


@dataclass(frozen=True, slots=True)
class Dist:
    """An integer length distribution: ``N`` (fixed), ``A-B`` (uniform, inclusive) or ``exp:MEAN``
    (exponential with that mean, at least 1). Draws are clamped to ``[1, cap]``."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Dist:
        t = text.strip().lower()
        try:
            if t.startswith("exp:"):
                mean = float(t[4:])
                if not mean >= 1 or not math.isfinite(mean):
                    raise ValueError
                return cls("exp", mean)
            if "-" in t:
                lo, hi = (int(x) for x in t.split("-", 1))
                if not 1 <= lo <= hi:
                    raise ValueError
                return cls("uniform", lo, hi)
            n = int(t)
            if n < 1:
                raise ValueError
            return cls("fixed", n)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected N, A-B (uniform) or exp:MEAN, with lengths of at least 1"
            ) from None

    def draw(self, rng: random.Random, cap: int) -> int:
        if self.kind == "fixed":
            v = int(self.a)
        elif self.kind == "uniform":
            v = rng.randint(int(self.a), int(self.b))
        else:
            v = round(rng.expovariate(1.0 / self.a))
        return max(1, min(cap, v))

    def mean(self) -> float:
        return (self.a + self.b) / 2 if self.kind == "uniform" else self.a

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        if self.kind == "uniform":
            return f"{int(self.a)}-{int(self.b)}"
        return f"exp:{self.a:g}"


SUBPROTOCOL_MODES = ("msgpack", "json", "both")
VERIFY_MODES = ("drops", "all", "none")
SCENARIOS = ("normal", "hostile-prompt", "flood", "store-cost")
MAX_SYSTEM_WORDS = 4000
GATEWAY_LOSS_IDLE = 16_000  # --scenario gateway-loss's idle connections when --idle is not given


@dataclass(slots=True)
class LoadConfig:
    url: str
    users: int = 8
    rate: float | None = None  # conversation arrivals per second (open loop); None: closed loop
    turns: int = 1
    requests: int | None = None
    duration: float | None = None
    prompt_words: Dist = Dist("uniform", 16, 64)
    # One app's fixed system prompt of this many words before every conversation (0: the model's default):
    # what --prompt-sharing tenant lets requests of different users share.
    system_words: int = 0
    max_tokens: Dist = Dist("uniform", 32, 128)
    temperature: float = 0.8
    cache: bool = False  # allow the server's response cache (seeded requests are otherwise cacheable)
    think: float = 0.0  # mean think time between turns, seconds (exponential); 0: none
    drop_rate: float = 0.0
    idle: int = 0
    idle_only: bool = False
    ping_interval: float = 5.0
    subprotocol: str = "msgpack"  # msgpack | json | both (users and idle connections alternate)
    coalesce_ms: int = 0  # hello.coalesce_ms of the users' connections (0: every delta as it comes)
    verify: str = "drops"  # which requests get a replay-from-0 check after done
    seed: int = 0
    request_timeout: float = 300.0
    connect_concurrency: int = 64
    token: str | None = None
    keyless: bool = False  # OpenAI doors: no Authorization (the server's anonymous owner, auth off)
    prompt_cache_key: bool = False  # OpenAI doors: each conversation sends its own prompt_cache_key
    server_pid: int | None = None
    sse_model: str = "SmolLM2-135M-Instruct"
    # tokenwire (WebSocket) | openai (streaming chat completions over HTTP) | openai-ws (Responses WebSocket)
    api: str = "tokenwire"
    api_model: str = "default"  # with api openai or openai-ws: the body's model
    json_path: Path | None = None
    plot_path: Path | None = None
    scenario: str = "normal"  # normal | hostile-prompt (hostile.py)

    def __post_init__(self) -> None:
        if self.requests is None and self.duration is None:
            self.duration = DEFAULT_DURATION_S
        if self.idle_only and self.idle < 1:
            raise ValueError("--idle-only needs --idle N with N >= 1")
        if self.users < 1 or self.turns < 1:
            raise ValueError("--users and --turns must be at least 1")
        if not 0.0 <= self.drop_rate <= 1.0:
            raise ValueError("--drop-rate must be in [0, 1]")
        if self.rate is not None and not self.rate > 0:
            raise ValueError("--rate must be positive")
        if not 0 <= self.system_words <= MAX_SYSTEM_WORDS:
            raise ValueError(f"--system-words must be 0-{MAX_SYSTEM_WORDS}")
        if not 0 <= self.coalesce_ms <= 1000:
            raise ValueError("--coalesce-ms must be 0-1000")
        if self.subprotocol not in SUBPROTOCOL_MODES:
            raise ValueError(f"--subprotocol must be one of {', '.join(SUBPROTOCOL_MODES)}")
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"--verify must be one of {', '.join(VERIFY_MODES)}")
        if self.scenario not in SCENARIOS:
            raise ValueError(f"--scenario must be one of {', '.join(SCENARIOS)}")
        if self.server_pid is not None and self.idle < 1 and self.scenario not in ("flood", "store-cost"):
            raise ValueError(
                "--server-pid is read with --idle N (memory and CPU per idle connection), --scenario flood "
                "(memory growth) and --scenario store-cost (CPU per token); here it would measure nothing"
            )
        if self.api != "tokenwire" and (self.idle or self.drop_rate or self.subprotocol != "msgpack"):
            raise ValueError(f"--api {self.api} has no --idle, --drop-rate or --subprotocol (OpenAI streams)")
        if self.api == "tokenwire" and (self.keyless or self.prompt_cache_key):
            raise ValueError("--keyless and --prompt-cache-key go with --api openai or openai-ws")
        if self.keyless and self.token:
            raise ValueError("--keyless sends no Authorization: not with --token")

    def describe(self) -> dict[str, object]:
        """The configuration as plain JSON values (for the report)."""
        return {
            "url": self.url,
            "mode": "idle-only" if self.idle_only else ("open" if self.rate else "closed"),
            "users": self.users,
            "rate": self.rate,
            "turns": self.turns,
            "requests": self.requests,
            "duration_s": self.duration,
            "prompt_words": str(self.prompt_words),
            "system_words": self.system_words,
            "max_tokens": str(self.max_tokens),
            "temperature": self.temperature,
            "cache": self.cache,
            "think_s": self.think,
            "drop_rate": self.drop_rate,
            "idle": self.idle,
            "ping_interval_s": self.ping_interval,
            "subprotocol": self.subprotocol,
            "coalesce_ms": self.coalesce_ms,
            "verify": self.verify,
            "seed": self.seed,
            "api": self.api,
            "keyless": self.keyless,
            "prompt_cache_key": self.prompt_cache_key,
        }


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``tokenwire load``."""
    p.add_argument("url", nargs="?", help="the server's WebSocket URL, e.g. ws://127.0.0.1:8765/v1/ws")
    p.add_argument(
        "--api",
        choices=("tokenwire", "openai", "openai-ws"),
        default="tokenwire",
        help="openai: drive any OpenAI-compatible server (URL http://HOST:PORT/v1) with streaming chat "
        "completions; openai-ws: with OpenAI's Responses WebSocket mode (GET /v1/responses upgraded, same "
        "URL); same workload and report (default: tokenwire's WebSocket protocol)",
    )
    p.add_argument(
        "--api-model", default="default", help="with --api openai or openai-ws: the model to ask for"
    )
    e = p.add_argument_group("engine only (no server: the overhead baseline)")
    e.add_argument(
        "--engine-only",
        action="store_true",
        help="no URL: load the model here and feed the same workload straight into the engine",
    )
    e.add_argument("--model", help="with --engine-only: a model folder (default: the packaged SmolLM2)")
    e.add_argument("--threads", type=int, help="with --engine-only: torch CPU threads (default: torch's)")
    e.add_argument(
        "--profile",
        action="store_true",
        help="with --engine-only: time every engine step by phase (as tokenwire bench --profile does) and "
        "report the median decode step at the most rows, phase by phase (engine_profile in --json)",
    )
    w = p.add_argument_group("workload")
    w.add_argument(
        "--users",
        type=int,
        default=8,
        help="concurrent users (closed loop), or the cap on concurrent conversations (open loop); default 8",
    )
    w.add_argument(
        "--rate",
        type=float,
        help="open loop: Poisson arrivals of new conversations per second "
        "(default: closed loop, each user starts its next conversation when one ends)",
    )
    w.add_argument("--turns", type=int, default=1, help="turns per conversation (one session each)")
    w.add_argument("--think", type=float, default=0.0, help="mean think time between turns, s (default 0)")
    w.add_argument(
        "--prompt-words",
        type=Dist.parse,
        default=Dist("uniform", 16, 64),
        help="words per user turn: N, A-B or exp:MEAN (default 16-64)",
    )
    w.add_argument(
        "--system-words",
        type=int,
        default=0,
        help="open every conversation with one fixed system prompt of N words, the same for all users "
        "(an app's own prompt: what --prompt-sharing tenant shares); default 0, the model's own",
    )
    w.add_argument(
        "--max-tokens",
        type=Dist.parse,
        default=Dist("uniform", 32, 128),
        help="params.max_tokens per request: N, A-B or exp:MEAN (default 32-128)",
    )
    w.add_argument("--temperature", type=float, default=0.8)
    w.add_argument(
        "--cache",
        action="store_true",
        help="let the server answer from its response cache (default: params.cache=false, since the "
        "seeded requests of a repeated run would otherwise be served from the cache, not generated)",
    )
    w.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths, drops and params.seed")
    w.add_argument(
        "--subprotocol",
        choices=SUBPROTOCOL_MODES,
        default="msgpack",
        help="both: users and idle connections alternate msgpack and JSON",
    )
    w.add_argument(
        "--coalesce-ms",
        type=int,
        default=0,
        help="ask for at most one delta per stream every N ms (hello.coalesce_ms, 0-1000; default 0)",
    )
    w.add_argument("--token", help="JWT for servers with auth on")
    w.add_argument(
        "--keyless",
        action="store_true",
        help="with --api openai or openai-ws: send no Authorization (every user the server's one anonymous "
        "owner, auth off, as keyless apps are; default: one fixed load key, so every user one owner)",
    )
    w.add_argument(
        "--prompt-cache-key",
        action="store_true",
        help="with --api openai or openai-ws: each conversation sends its own prompt_cache_key (OpenAI's)",
    )
    w.add_argument(
        "--scenario",
        choices=(*SCENARIOS, "soak", "noisy-neighbour", "gateway-loss"),
        default="normal",
        help="normal: the workload above; hostile-prompt: the workload alone, then again while one client "
        "sends ~1 MiB 64-message chats; soak: --requests short chats (default 10000), then wait out "
        "--retention and report the store's memory at start, peak and end (needs --redis-url); "
        "noisy-neighbour: light users alone, then beside a heavy user under FIFO and fair share (starts its "
        "own servers: no URL); flood: the workload alone, then during --flood-duration of hostile clients "
        "on every door (pass --server-pid for the gateway's memory); store-cost: Redis commands, CPU and "
        "bytes per token, per request and per resume, and bytes per idle session (needs --redis-url: a "
        "Redis of the server's own); gateway-loss: kill -9 the busiest gateway of a local cluster (URL: "
        "the first gateway) holding --idle and --streams connections, and time its clients' return to the "
        "others (server/load/gateway_loss.py)",
    )
    b = p.add_argument_group("bounds (default: --duration 30)")
    b.add_argument(
        "--duration", type=argtypes.positive_seconds, help="issue no new request after this many seconds"
    )
    b.add_argument("--requests", type=argtypes.at_least_one, help="issue this many requests in all")
    b.add_argument("--request-timeout", type=float, default=300.0, help="per request, s (default 300)")
    r = p.add_argument_group("resilience")
    r.add_argument(
        "--drop-rate",
        type=float,
        default=0.0,
        help="share of requests whose connection is "
        "killed at a random token mid-stream, then reconnected and resumed (default 0)",
    )
    r.add_argument(
        "--verify",
        choices=VERIFY_MODES,
        default="drops",
        help="replay which finished requests "
        "from offset 0 and compare texts (default: those that were dropped)",
    )
    i = p.add_argument_group("idle connections")
    i.add_argument(
        "--idle",
        type=int,
        help="hold N extra connections that only send pings "
        f"(default 0; gateway-loss: {GATEWAY_LOSS_IDLE:,})",
    )
    i.add_argument("--idle-only", action="store_true", help="no chat traffic: only the idle connections")
    i.add_argument("--ping-interval", type=float, default=5.0, help="seconds between pings (default 5)")
    i.add_argument(
        "--connect-concurrency", type=int, default=64, help="handshakes in flight at once (default 64)"
    )
    i.add_argument(
        "--server-pid", type=int, help="a local server's pid: report its memory per idle connection"
    )
    k = p.add_argument_group("soak (--scenario soak: does the store's memory come back after retention?)")
    k.add_argument(
        "--redis-url",
        help="soak, store-cost, gateway-loss: the server's Redis (give it one of its own: INFO is "
        "server-wide)",
    )
    k.add_argument(
        "--key-prefix", default="tw:", help="soak, store-cost: the server's --key-prefix (default tw:)"
    )
    k.add_argument(
        "--retention", type=float, default=60.0, help="soak: the server's --retention, seconds (default 60)"
    )
    f = p.add_argument_group("flood (--scenario flood: does any frame or request get past admission?)")
    f.add_argument(
        "--flood-clients", type=int, default=4, help="flood: hostile WebSocket clients (default 4)"
    )
    f.add_argument("--flood-duration", type=float, default=60.0, help="flood: seconds of flood (default 60)")
    o = p.add_argument_group("output")
    o.add_argument("--json", dest="json_path", type=Path, metavar="FILE", help="write the report as JSON")
    o.add_argument(
        "--plot",
        dest="plot_path",
        type=Path,
        metavar="FILE",
        help="write latency CDFs and tokens/s over time as a PNG",
    )
    o.add_argument(
        "--sse-model",
        default="SmolLM2-135M-Instruct",
        help="the model name written in the SSE comparison chunks",
    )
    o.add_argument("--no-progress", action="store_true", help="no live progress bar")
    from server.load.noisy import add_scenario_arguments

    add_scenario_arguments(p)
    _gateway_loss_arguments(p)


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    if args.engine_only == bool(args.url):
        raise ValueError("give the server's URL, or --engine-only (not both)")
    if args.engine_only and (args.idle or args.drop_rate):
        raise ValueError("--engine-only has no connections: no --idle, no --drop-rate")
    if not args.engine_only and (args.model or args.threads or args.profile):
        raise ValueError("--model, --threads and --profile go with --engine-only")
    return LoadConfig(
        url=args.url or "engine-only",
        users=args.users,
        rate=args.rate,
        turns=args.turns,
        requests=args.requests,
        duration=args.duration,
        prompt_words=args.prompt_words,
        system_words=args.system_words,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        cache=args.cache,
        think=args.think,
        drop_rate=args.drop_rate,
        idle=args.idle or 0,
        idle_only=args.idle_only,
        ping_interval=args.ping_interval,
        subprotocol=args.subprotocol,
        coalesce_ms=args.coalesce_ms,
        verify=args.verify,
        seed=args.seed,
        request_timeout=args.request_timeout,
        connect_concurrency=args.connect_concurrency,
        token=args.token,
        keyless=args.keyless,
        prompt_cache_key=args.prompt_cache_key,
        scenario=args.scenario,
        server_pid=args.server_pid,
        sse_model=args.sse_model,
        api=args.api,
        api_model=args.api_model,
        json_path=args.json_path,
        plot_path=args.plot_path,
    )


def _gateway_loss_arguments(p: argparse.ArgumentParser) -> None:
    """``--scenario gateway-loss``'s own flags (server/load/gateway_loss.py; ``--idle``, ``--seed``,
    ``--redis-url``, ``--connect-concurrency``, ``--request-timeout`` and ``--json`` are shared)."""
    g = p.add_argument_group(
        "--scenario gateway-loss (kill -9 the busiest gateway of a local cluster under load; --idle defaults "
        f"to {GATEWAY_LOSS_IDLE:,} there)"
    )
    g.add_argument(
        "--gateways", type=int, default=4, help="gateways on consecutive ports from URL's (default 4)"
    )
    g.add_argument(
        "--gateway-url", action="append", metavar="URL", help="a gateway's URL instead (repeat for each)"
    )
    g.add_argument(
        "--gateway-pid",
        action="append",
        type=int,
        metavar="PID",
        help="a gateway's pid, in URL order (repeat; default: the process listening on each URL's port, "
        "found in /proc)",
    )
    g.add_argument("--streams", type=int, default=64, help="conversations chatting continuously (default 64)")
    g.add_argument(
        "--stream-max-tokens", type=int, default=128, help="max_tokens of each of their replies (default 128)"
    )
    g.add_argument(
        "--idle-per-process",
        type=int,
        default=4000,
        help="idle connections per child process of the load tool (default 4000)",
    )
    g.add_argument(
        "--kill-after-tokens",
        type=int,
        default=4,
        help="kill once --kill-share of the victim's streams hold this many tokens of a reply (default 4)",
    )
    g.add_argument(
        "--kill-share",
        type=float,
        default=0.5,
        help="... this share of them (default 0.5: on CPU, an engine runs 32 at once, the rest wait)",
    )
    g.add_argument(
        "--kill-wait", type=float, default=60.0, help="... or after this many seconds anyway (default 60)"
    )
    g.add_argument(
        "--baseline", type=float, default=3.0, help="seconds of steady load measured before the kill (3)"
    )
    g.add_argument(
        "--settle",
        type=float,
        default=5.0,
        help="seconds after the last reconnect for the 'after' figures (5)",
    )
    g.add_argument(
        "--recover-timeout",
        type=float,
        default=120.0,
        help="every client must be back within this many seconds of the kill (default 120)",
    )
    g.add_argument(
        "--reconnect-initial-ms",
        type=int,
        default=300,
        help="backoff: the first delay is uniform in [0, this] ms, doubling per attempt (default 300)",
    )
    g.add_argument("--reconnect-max-ms", type=int, default=10_000, help="backoff cap, ms (default 10000)")
