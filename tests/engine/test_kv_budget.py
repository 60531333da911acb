"""``--kv-budget-mb``: the KV cache the engine allocates follows the budget it is given, and the CPU
default fits small machines."""

from __future__ import annotations

from pathlib import Path

from server.app import load_engine
from server.cli import _config
from server.engine.engine import cpu_kv_budget_mb


def test_cpu_default_is_at_most_an_eighth_of_memory_and_at_most_a_gib() -> None:
    import os

    total_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20
    assert 128 <= cpu_kv_budget_mb() <= max(128, min(1024, total_mb // 8))


def test_kv_budget_flag_sizes_the_engines_cache(tiny_model_dir: Path) -> None:
    small = load_engine(str(tiny_model_dir), device="cpu", kv_budget_mb=1)[1]
    large = load_engine(str(tiny_model_dir), device="cpu", kv_budget_mb=8)[1]
    # The tiny model's KV per token is small; the budget decides how many slots there are (at least one
    # full-context slot whatever the budget).
    assert small.runner.stats.kv_bytes < large.runner.stats.kv_bytes <= 8 << 20
    import argparse

    args = argparse.Namespace(
        redis_url=None, key_prefix="tw:", lease_ttl=10.0, kv_budget_mb=8, log_level="info", command="serve"
    )
    assert _config(args).kv_budget_mb == 8


def test_prompt_sharing_flag_reaches_the_scheduler(tiny_model_dir: Path) -> None:
    """``--prompt-sharing public|tenant|off`` (serve, worker; cluster passes it to its workers)."""
    import pytest

    from server.cli import build_parser
    from server.engine.engine import default_config

    seen = {}
    for mode in ("public", "tenant", "off"):
        args = build_parser().parse_args(["serve", "--prompt-sharing", mode])
        cfg = _config(args)
        assert cfg.prompt_sharing == mode
        engine = load_engine(str(tiny_model_dir), device="cpu", prompt_sharing=cfg.prompt_sharing)[1]
        sched = engine.sched.cfg
        seen[mode] = (sched.share_min_tokens > 0, sched.share_across_users)
    assert seen == {"public": (True, False), "tenant": (True, True), "off": (False, False)}
    assert build_parser().parse_args(["worker", "--redis-url", "redis://x"]).prompt_sharing == "public"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--prompt-sharing", "everyone"])
    with pytest.raises(ValueError, match="prompt sharing"):
        default_config(load_engine(str(tiny_model_dir), device="cpu")[0], prompt_sharing="everyone")
