"""The ``tokenwire`` command."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from pathlib import Path

from server import __version__

DEFAULT_URL = "ws://127.0.0.1:8765/v1/ws"


def _serve(args: argparse.Namespace) -> int:
    from server.app import ServeConfig, serve
    from server.gateway.server import GatewaySettings
    from server.logs import configure

    configure(args.log_level)
    cfg = ServeConfig(
        gateway=GatewaySettings(
            host=args.host,
            port=args.port,
            auth_secret=args.auth_secret or os.environ.get("TOKENWIRE_AUTH_SECRET") or None,
        ),
        redis_url=args.redis_url or os.environ.get("TOKENWIRE_REDIS_URL") or None,
        data_dir=Path(args.data_dir or os.environ.get("TOKENWIRE_DATA") or ".tokenwire"),
        key_prefix=args.key_prefix,
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        session_secret=os.environ.get("TOKENWIRE_SESSION_SECRET") or None,
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(cfg))
    return 0


def _chat(args: argparse.Namespace) -> int:
    from server.chat_cli import run_chat

    return asyncio.run(
        run_chat(
            args.url,
            token=args.token,
            once=args.message,
            temperature=args.temperature,
            max_tokens=args.max_tokens,
        )
    )


def _bench(args: argparse.Namespace) -> int:
    from server.engine.bench import PATHS, main

    paths = args.paths.split(",") if args.paths else PATHS
    main(
        json_path=args.json,
        turns=args.turns,
        device=args.device,
        random_weights=args.random_weights,
        requests=args.requests,
        seed=args.seed,
        model=args.model,
        dtype=args.dtype,
        paths=paths,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tokenwire", description="WebSocket chat server for LLMs")
    p.add_argument("--version", action="version", version=f"tokenwire {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run gateway + worker in one process (embedded Valkey by default)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8765, help="0 picks a free port (printed on stdout)")
    s.add_argument("--redis-url", help="external Redis/Valkey (default: start an embedded Valkey)")
    s.add_argument("--data-dir", help="embedded Valkey data (default $TOKENWIRE_DATA or ./.tokenwire)")
    s.add_argument("--key-prefix", default="tw:", help="prefix of every Redis key (default tw:)")
    s.add_argument("--model", help="a Hugging Face causal-LM folder (default: the packaged SmolLM2-135M)")
    s.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    s.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16")
    s.add_argument(
        "--auth-secret",
        help="require hello.token: an HS256 JWT signed with this secret (or $TOKENWIRE_AUTH_SECRET)",
    )
    s.add_argument("--log-level", default="info")
    s.set_defaults(func=_serve)

    c = sub.add_parser("chat", help="chat in the terminal with a running server")
    c.add_argument("url", nargs="?", default=DEFAULT_URL)
    c.add_argument("--token", help="JWT for servers with auth on")
    c.add_argument("-m", "--message", help="ask one question, print the streamed answer, exit")
    c.add_argument("--temperature", type=float)
    c.add_argument("--max-tokens", type=int)
    c.set_defaults(func=_chat)

    b = sub.add_parser("bench", help="engine throughput and latency against transformers baselines")
    b.add_argument("--json", metavar="FILE", help="write the results as JSON")
    b.add_argument("--turns", type=int, default=0, help="also measure TTFT per turn of an N-turn session")
    b.add_argument("--device", default="auto")
    b.add_argument("--random-weights", metavar="CONFIG", help="random Llama: 1b, 135m or a config.json")
    b.add_argument("--requests", type=int, default=32)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--model", help="a Hugging Face causal-LM folder (default: the packaged SmolLM2-135M)")
    b.add_argument("--dtype", default="auto")
    b.add_argument("--paths", help="comma-separated subset of ceiling,static,hf_cb,engine,engine_poisson")
    b.set_defaults(func=_bench)

    args = p.parse_args(argv)
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
