"""``tokenwire load --scenario gateway-loss``, small: ``tokenwire cluster --gateways 4 --workers 1`` on the
tiny model, 400 idle connections (in two child processes of the load tool) and 8 streams chatting
greedily; the busiest gateway is killed with SIGKILL while its streams are mid-reply. Every client of it
comes back on another gateway with its own session, every stream resumes where it was, and nothing is
lost, repeated or refused but by the protocol's documented refusals. The full version (16,000 + 64) is
``make bench``'s gateway-loss section."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import uuid
from pathlib import Path

from tests.conftest import delete_prefix
from tests.e2e.test_cluster_command import _free_consecutive_ports, _until_ready

IDLE = 400
STREAMS = 8
GATEWAYS = 4


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass


async def test_losing_the_busiest_gateway_under_load_loses_nothing(
    peaky_model_dir: Path, redis_url: str, tmp_path: Path
) -> None:
    port = _free_consecutive_ports(GATEWAYS)
    prefix = f"twtest:gwloss:{uuid.uuid4().hex[:8]}:"
    cluster = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "server.cli", "cluster", "--gateways", str(GATEWAYS), "--workers", "1",
        "--port", str(port), "--redis-url", redis_url, "--key-prefix", prefix,
        "--model", str(peaky_model_dir), "--log-level", "warning",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    drain: asyncio.Task[None] | None = None
    try:
        assert cluster.stdout is not None
        await _until_ready(cluster.stdout)
        drain = asyncio.create_task(_drain(cluster.stdout))  # it says "gateway-N exited with -9"
        out = tmp_path / "gateway-loss.json"
        load = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "server.cli", "load", f"ws://127.0.0.1:{port}/v1/ws",
            "--scenario", "gateway-loss", "--gateways", str(GATEWAYS), "--idle", str(IDLE),
            "--idle-per-process", str(IDLE // 2), "--streams", str(STREAMS), "--stream-max-tokens", "160",
            "--redis-url", redis_url, "--baseline", "1", "--settle", "1", "--kill-share", "1",
            "--kill-wait", "20", "--recover-timeout", "30", "--request-timeout", "60", "--json", str(out),
            "--no-progress",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        said, _ = await asyncio.wait_for(load.communicate(), 150)
        text = said.decode(errors="replace")
        print(text)  # the load tool's progress lines and table: pytest shows them when an assertion fails
        assert load.returncode == 0, text[-4000:]
        r = json.loads(out.read_text())
    finally:
        if cluster.returncode is None:
            os.killpg(cluster.pid, signal.SIGINT)
            try:
                await asyncio.wait_for(cluster.wait(), 60)
            except TimeoutError:
                os.killpg(cluster.pid, signal.SIGKILL)
                await cluster.wait()
        if drain is not None:
            await drain
        delete_prefix(redis_url, prefix)

    assert all(r["met"].values()), r["met"]
    victim = r["victim"]
    gateways = r["gateways"]
    assert [g["killed"] for g in gateways].count(True) == 1 and gateways[victim["gateway"]]["killed"]
    assert len({g["pid"] for g in gateways}) == GATEWAYS  # found from the listening ports
    # The connections were spread round-robin; the victim held the most (ties: the first).
    assert sum(g["idle"] for g in gateways) == IDLE and sum(g["streams"] for g in gateways) == STREAMS
    assert victim["connections"] == max(g["idle"] + g["streams"] for g in gateways)
    st, idle, tk = r["streams"], r["idle"], r["tokens"]
    # The victim's streams were mid-reply, each came back attached, and the interrupted replies resumed
    # from where they were: nothing lost or repeated, each replay from the store equal to the live text.
    assert st["on_victim"] == STREAMS // GATEWAYS and st["mid_reply_at_kill"] >= 1
    assert st["moved"] == st["reattached"] == st["on_victim"] and st["unexpected_losses"] == 0
    assert st["interrupted_mid_reply"] >= 1 and st["verified"] >= st["interrupted_mid_reply"]
    assert r["streams_reattach_s"] is not None and r["streams_reattach_s"] < 30
    assert st["replies_failed"] == 0 and st["replies_ended"] == st["replies"]
    assert tk["lost"] == tk["duplicated"] == tk["replay_mismatches"] == 0 and tk["violations"] == []
    # Every idle connection of the victim came back (to the others only), none of the others dropped.
    assert idle["connected"] == IDLE and idle["processes"] == 2
    assert idle["back"] == idle["lost"] == idle["on_victim"] == IDLE // GATEWAYS
    assert [n for g, n in enumerate(idle["lost_by_gateway"]) if g != victim["gateway"]] == [0] * (
        GATEWAYS - 1
    )
    assert r["idle_reattach_s"] is not None and r["idle_reattach_s"] < 30
    assert r["connections_moved"] == IDLE // GATEWAYS + STREAMS // GATEWAYS
    # No internal error; nothing refused but with retry_after_ms (rate_limited, overloaded).
    er = r["errors"]
    assert er["internal"] == 0 and er["other"] == {} and er["refusals_without_retry_after"] == {}
    # The figures are there: Redis sampled through the herd, the 3 survivors' CPU and memory read.
    assert r["redis"]["error"] is None and r["redis"]["peak_ops_per_s"] > 0
    survivors = r["survivors"]
    assert len(survivors) == GATEWAYS - 1 and victim["gateway"] not in {s["gateway"] for s in survivors}
    for s in survivors:
        assert s["rss_before_mib"] > 0 and s["rss_peak_mib"] > 0 and s["rss_after_mib"] > 0
        assert s["cpu_peak_pct"] is not None and s["herd_cpu_s"] is not None
    assert "tokens lost / duplicated" in text  # the table was printed
