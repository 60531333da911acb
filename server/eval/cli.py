"""``tokenwire eval``: score sampling settings on about 40 checked prompts with the real model, and say
which setting should be the default (the one with the best pass rate among those that rarely loop).

    tokenwire eval                       # the whole grid, 3 seeds per sampled setting (minutes)
    tokenwire eval --settings defaults   # only what a chat that sets nothing gets
    tokenwire eval --cases code --show   # the code cases, with every reply printed
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from server.eval.cases import KINDS
from server.eval.run import (
    LOOP_LIMIT,
    Reply,
    cases_named,
    check,
    choose,
    generate,
    plan,
    score,
    server_defaults,
    settings_named,
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tokenwire eval",
        description="Score sampling settings on checked prompts with the real model; choose the defaults.",
    )
    p.add_argument("--model", help="a Hugging Face causal-LM folder (default: the packaged SmolLM2-135M)")
    p.add_argument("--dtype", default="auto", help="auto (as tokenwire serve picks), float32, bfloat16")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument(
        "--settings", default="grid", help="grid (default), defaults, or comma-separated grid setting names"
    )
    p.add_argument(
        "--cases", help="comma-separated case names or kinds (" + ", ".join(KINDS) + "); default all"
    )
    p.add_argument("--seeds", type=int, default=3, help="runs of each sampled setting (default 3)")
    p.add_argument("--max-tokens", type=int, default=256, help="longest reply (default 256, the server's)")
    p.add_argument("--json", metavar="FILE", help="write the scores and every reply as JSON")
    p.add_argument("--show", action="store_true", help="print every reply with its verdict")
    return p


def render(scores: Sequence[dict[str, Any]], chosen: str | None, now: str | None) -> str:
    """Scores (``Score.as_json()``, or read back from ``--json``) as a Markdown table: the chosen setting
    and the one the server applies now are marked."""
    head = "| setting | pass | " + " | ".join(KINDS) + " | loops | cut at max | mean tokens | |"
    rows = [head, "|" + " --- |" + " ---: |" * (len(KINDS) + 4) + " --- |"]
    for s in scores:
        marks = [m for m, name in (("**chosen**", chosen), ("the server's now", now)) if s["setting"] == name]
        kinds = " | ".join("-" if s["by_kind"][k] is None else f"{s['by_kind'][k]:.0%}" for k in KINDS)
        rows.append(
            f"| {s['setting']} | {s['pass_rate']:.1%} | {kinds} | {s['loop_rate']:.1%} | "
            f"{s['cut_rate']:.0%} | {s['mean_tokens']:.0f} | {', '.join(marks)} |"
        )
    return "\n".join(rows)


def _reply_json(r: Reply) -> dict[str, object]:
    return {
        "case": r.case.name,
        "kind": r.case.kind,
        "setting": r.setting.name,
        "seed": r.seed,
        "passed": r.passed,
        "looped": r.looped,
        "finish": r.finish,
        "tokens": r.tokens,
        "text": r.text,
    }


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        settings = settings_named(args.settings)
        cases = cases_named(args.cases)
    except ValueError as exc:
        print(f"tokenwire eval: {exc}", file=sys.stderr)
        return 2
    if args.seeds < 1 or args.max_tokens < 1:
        print("tokenwire eval: --seeds and --max-tokens must be at least 1", file=sys.stderr)
        return 2

    from server.app import load_engine, use_threads
    from server.engine.machine import cpu_info, cpu_line

    use_threads(args.threads)
    loaded, engine = load_engine(args.model, device=args.device, dtype=args.dtype)
    cpu = cpu_info()
    replies = plan(settings, cases, args.seeds)
    print(
        f"tokenwire eval: {len(cases)} cases x {len(settings)} settings = {len(replies)} replies, model "
        f"{loaded.name} on {loaded.device} in {loaded.dtype_name}; {cpu_line(cpu)}",
        file=sys.stderr,
        flush=True,
    )
    t0 = time.perf_counter()
    last = [0.0]

    def progress(n: int, total: int) -> None:
        now = time.perf_counter()
        if n == total or now - last[0] >= 10:
            last[0] = now
            print(f"  {n}/{total} replies, {now - t0:.0f} s", file=sys.stderr, flush=True)

    generate(engine, replies, args.max_tokens, progress)
    check(replies)
    scores = score(replies)
    chosen = choose(scores)
    if args.show:
        for r in replies:
            verdict = ("pass" if r.passed else "FAIL") + (" LOOP" if r.looped else "")
            print(f"--- {r.setting.name} / {r.case.name} / seed {r.seed}: {verdict} ({r.finish}, {r.tokens})")
            print(r.text)
    now = server_defaults()
    now_name = next((s.setting.name for s in scores if s.setting.same_as(now)), None)
    table = [s.as_json() for s in scores]
    print(render(table, chosen.setting.name if chosen else None, now_name))
    if chosen is None:
        print(f"\nno setting loops on at most {LOOP_LIMIT:.0%} of its replies; none chosen")
    else:
        print(f"\nchosen: {chosen.setting.name} (best pass rate with loops at most {LOOP_LIMIT:.0%})")
    seconds = time.perf_counter() - t0
    print(f"{len(replies)} replies in {seconds:.0f} s", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "model": loaded.name,
                    "cpu": cpu,
                    "device": loaded.device,
                    "dtype": loaded.dtype_name,
                    "cases": len(cases),
                    "seeds": args.seeds,
                    "max_tokens": args.max_tokens,
                    "loop_limit": LOOP_LIMIT,
                    "seconds": round(seconds, 1),
                    "chosen": chosen.setting.name if chosen else None,
                    "server_defaults": now_name,
                    "scores": table,
                    "replies": [_reply_json(r) for r in replies],
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
