"""``tokenwire load --scenario noisy-neighbour`` end to end on the tiny model, kept short.

No timed assertions (the machine is shared): the three phases must each start their own server with the
right scheduling, the light users must get answers in every phase, the heavy user only where it belongs,
and the JSON must carry the keys ``make bench`` reads.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from server.load.benchmarks import render_noisy


def test_noisy_neighbour_runs_three_phases_and_writes_the_keys(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "noisy.json"
    cmd = [sys.executable, "-m", "server.cli", "load", "--scenario", "noisy-neighbour", "--model"]
    cmd += [str(tiny_model_dir), "--duration", "2", "--warmup", "1", "--grace", "60", "--heavy-streams", "8"]
    cmd += ["--heavy-max-tokens", "48", "--light-max-tokens", "8", "--json", str(out), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert [r[p]["scheduling"] for p in ("alone", "fifo", "fair")] == ["fair", "fifo", "fair"]
    for phase in ("alone", "fifo", "fair"):
        x = r[phase]
        assert x["light_chats"] > 0 and x["light_ttft_p99_ms"] >= x["light_ttft_p50_ms"] > 0
        assert x["error_count"] == 0
        assert x["tok_s"] >= x["light_tok_s"]
    assert r["alone"]["heavy_tok_s"] == 0 and r["alone"]["requests_done"]["heavy"] == 0
    assert r["fifo"]["heavy_tok_s"] > 0 and r["fair"]["heavy_tok_s"] > 0
    # The heavy user really holds more streams than it has connections (it sends messages-mode chats:
    # content-mode turns of one session would run one at a time).
    assert r["fifo"]["heavy_streams_max"] > 4 and r["fair"]["heavy_streams_max"] > 4
    assert set(r["ratios"]) == {"fair_p99_vs_alone", "fair_p99_vs_fifo", "fair_tok_s_vs_fifo"}
    assert r["config"]["order"] == ["alone", "fifo", "fair"]
    text = "\n".join(render_noisy(r))  # the BENCHMARKS.md section make bench writes from it
    assert "| heavy user, fair |" in text and "target ≥ 0.95x" in text


def test_noisy_neighbour_takes_no_url() -> None:
    cmd = [
        sys.executable,
        "-m",
        "server.cli",
        "load",
        "ws://127.0.0.1:1/v1/ws",
        "--scenario",
        "noisy-neighbour",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "give no URL" in proc.stderr
