"""``tokenwire load`` against the real ``tokenwire serve`` (tiny model) for a few seconds.

Small numbers and no timed assertions (the machine is shared): the report must be consistent (counts add
up, nothing failed, every text intact across planned connection kills, pings answered, byte figures
present and smaller than the SSE equivalent) and the files it promises must exist.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.load.cli import run
from server.load.options import Dist, LoadConfig
from tests.conftest import delete_prefix
from tests.e2e.serve_process import ServeProcess


@pytest.fixture(scope="module")
def served(
    tiny_model_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServeProcess]:
    data = tmp_path_factory.mktemp("load-serve")
    prefix = f"twtest:load:{data.name}:"
    p = ServeProcess(["--model", str(tiny_model_dir), "--redis-url", redis_url, "--key-prefix", prefix], data)
    p.start()
    try:
        yield p
    finally:
        assert p.stop() == 0, p.stderr_path.read_text()[-2000:]
        delete_prefix(redis_url, prefix)


def _tokens_generated(ws_url: str) -> float:
    http = ws_url.replace("ws://", "http://").replace("/v1/ws", "/metrics")
    with urllib.request.urlopen(http, timeout=10) as r:
        families = text_string_to_metric_families(r.read().decode())
    return sum(s.value for f in families for s in f.samples if s.name == "tokenwire_tokens_generated_total")


def _check_counts(rep: dict[str, Any]) -> None:
    rq, tk, dr = rep["requests"], rep["tokens"], rep["drops"]
    assert rq["issued"] == rq["ok"] + rq["failed"]
    assert sum(rq["failed_by_code"].values()) == rq["failed"]
    assert sum(rq["finish_reasons"].values()) == rq["issued"]
    assert sum(rq["length_reasons"].values()) == rq["finish_reasons"].get("length", 0)
    assert rq["failed"] == 0, rq["failed_by_code"]
    assert dr["integrity_violations"] == 0, dr["violations"]
    assert tk["completion"] > 0 and tk["completion"] == tk["streamed_live"]
    assert rep["ttft_ms"]["n"] == rq["ok"]
    assert dr["resumes"] >= dr["kills"]  # each kill was followed by a reconnect that resumed


def test_load_cli_closed_loop_with_drops_idle_and_both_subprotocols(
    served: ServeProcess, tmp_path: Path
) -> None:
    assert served.proc is not None
    out_json, out_png = tmp_path / "load.json", tmp_path / "load.png"
    cmd = [
        sys.executable, "-m", "server.cli", "load", served.url,
        "--users", "4", "--turns", "2", "--requests", "16", "--duration", "60",
        "--max-tokens", "12-40", "--prompt-words", "8-24",
        "--drop-rate", "0.5", "--idle", "20", "--ping-interval", "0.3",
        "--subprotocol", "both", "--server-pid", str(served.proc.pid),
        "--json", str(out_json), "--plot", str(out_png), "--no-progress",
    ]  # fmt: skip
    before = _tokens_generated(served.url)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    generated = _tokens_generated(served.url) - before
    assert "integrity violations" in done.stdout  # the table was printed
    assert "finishes" in done.stdout
    rep = json.loads(out_json.read_text())
    _check_counts(rep)
    rq, dr = rep["requests"], rep["drops"]
    assert rq["issued"] == rq["ok"] == 16
    # The server's own count of tokens it generated (Prometheus) equals what the clients received.
    assert generated == rep["tokens"]["completion"]
    assert dr["planned"] > 0 and dr["kills"] > 0 and dr["resumes"] > 0
    assert rep["itl_ms"]["n"] > 0
    assert dr["replays_verified"] >= 1  # the killed requests were replayed from offset 0 and compared
    assert rep["servers"]

    wire = rep["wire"]
    assert set(wire["measured"]) == {"msgpack", "json"}  # both subprotocols carried live streams
    for name in ("msgpack", "json"):
        assert wire["measured"][name]["tokens"] > 0
        assert 0 < wire["bytes_per_token"][name] < wire["bytes_per_token"]["sse"]
    assert 0 < wire["ratio_to_sse"]["msgpack"] < wire["ratio_to_sse"]["json"] < 1
    assert wire["computed"]["sse"]["tokens"] == rep["tokens"]["streamed_live"]

    idle = rep["idle"]
    assert idle["target"] == idle["connected"] == 20
    assert idle["pings"] > 0 and idle["pongs"] == idle["pings"] and idle["lost"] == 0
    assert idle["rtt_ms"]["n"] + idle["rtt_during_ramp_ms"]["n"] == idle["pongs"]
    assert idle["server_rss_before_kib"] and idle["server_rss_after_kib"]

    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def test_load_open_loop_verifies_every_text(served: ServeProcess, tmp_path: Path) -> None:
    cfg = LoadConfig(
        url=served.url,
        users=6,
        rate=8.0,
        requests=12,
        duration=30,
        max_tokens=Dist("uniform", 8, 24),
        prompt_words=Dist("exp", 12),
        subprotocol="json",
        verify="all",
        json_path=tmp_path / "open.json",
    )
    rep = await run(cfg, progress=False)
    assert json.loads((tmp_path / "open.json").read_text()) == rep
    _check_counts(rep)
    assert rep["config"]["mode"] == "open"
    assert rep["requests"]["ok"] == rep["requests"]["issued"] == 12
    assert rep["drops"]["replays_verified"] == 12 and rep["drops"]["kills"] == 0
    assert rep["arrivals"]["n"] >= 12
    assert set(rep["wire"]["measured"]) == {"json"}


async def test_load_idle_only_holds_and_pings(served: ServeProcess) -> None:
    cfg = LoadConfig(url=served.url, idle=60, idle_only=True, duration=1.5, ping_interval=0.3)
    rep = await run(cfg, progress=False)
    assert rep["requests"]["issued"] == 0
    idle = rep["idle"]
    assert idle["connected"] == 60 and not idle["connect_failed"] and idle["closed_by_server"] == 0
    assert idle["rtt_ms"]["n"] > 0 and idle["rtt_ms"]["p99"] is not None
    assert idle["pongs"] == idle["pings"]


def test_server_pid_where_nothing_reads_it_is_refused() -> None:
    """--server-pid on a plain load would measure nothing: said, not silently ignored (issue 29)."""
    with pytest.raises(ValueError, match="--server-pid"):
        LoadConfig(url="ws://127.0.0.1:1/v1/ws", server_pid=1)
    LoadConfig(url="ws://127.0.0.1:1/v1/ws", server_pid=1, idle=5)  # read: memory per idle connection
    LoadConfig(url="ws://127.0.0.1:1/v1/ws", server_pid=1, scenario="store-cost")


def test_a_server_that_is_not_there_is_said_with_its_reason(tmp_path: Path) -> None:
    """Nothing listens at the URL: the report names why the connections failed, not a bare count."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    out = tmp_path / "report.json"
    url = f"ws://127.0.0.1:{port}/v1/ws"
    done = subprocess.run(
        [sys.executable, "-m", "server.cli", "load", url, "--requests", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0, done.stdout[-2000:]
    rq = json.loads(out.read_text())["requests"]
    assert rq["failed_by_code"] == {"connect_failed": 1}
    why = rq["last_connect_error"].lower()
    assert "refused" in why or "connect call failed" in why, why
    assert "connect error" in done.stdout


def test_requests_are_seeded_unique_and_skip_the_response_cache() -> None:
    from server.load.conversation import Conversation
    from server.load.runner import RunState

    def chat(cfg: LoadConfig, user: int, conv: int, turn: int) -> Any:
        return Conversation(RunState(cfg), user, conv, "tokenwire.v1.msgpack")._new_request(turn)

    cfg = LoadConfig(url="ws://unused/v1/ws", requests=1, drop_rate=0.5)
    (rec_a, live_a), (rec_b, live_b) = chat(cfg, 1, 2, 0), chat(cfg, 1, 2, 0)
    assert live_a.chat.content == live_b.chat.content and live_a.chat.params == live_b.chat.params
    assert rec_a.kill_at == rec_b.kill_at
    assert live_a.chat.id != live_b.chat.id  # a new run tag each run: ids never collide with old logs
    assert live_a.chat.params.cache is False and live_a.chat.params.seed is not None
    assert chat(cfg, 1, 3, 0)[1].chat.params.seed != live_a.chat.params.seed
    cached = LoadConfig(url="ws://unused/v1/ws", requests=1, cache=True)
    assert chat(cached, 1, 2, 0)[1].chat.params.cache is None


async def test_engine_only_runs_the_same_workload_as_the_server(
    served: ServeProcess, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """--engine-only draws the same requests and builds the same prompts as the WebSocket users: with one
    user (so the same conversations run in the same order) and greedy decoding, both runs produce exactly
    the same prompt and completion token counts."""
    from server.load.cli import _load_engine

    def cfg(url: str) -> LoadConfig:
        return LoadConfig(
            url=url,
            users=1,
            requests=5,
            turns=2,
            temperature=0.0,
            max_tokens=Dist("uniform", 4, 24),
            prompt_words=Dist("uniform", 4, 16),
            seed=7,
        )

    over_ws = await run(cfg(served.url), progress=False)
    engine_only = await run(
        cfg("engine-only"), progress=False, engine=_load_engine(str(tiny_model_dir), None), profile=True
    )
    _check_counts(engine_only)
    assert engine_only["servers"] == ["engine-only"]
    assert engine_only["requests"]["ok"] == over_ws["requests"]["ok"] == 5
    for key in ("completion", "prompt"):
        assert engine_only["tokens"][key] == over_ws["tokens"][key], key
    # Which limit ended each length finish: the same on both paths, and always said (never "unsaid").
    lengths = over_ws["requests"]["length_reasons"]
    assert engine_only["requests"]["length_reasons"] == lengths and set(lengths) <= {"max_tokens", "context"}
    assert engine_only["tokens"]["per_s"] > 0 and engine_only["ttft_ms"]["n"] == 5
    assert not engine_only["wire"]["measured"]  # no wire: nothing to count
    # --profile: the median decode step at the one row a single user makes, phase by phase.
    prof = engine_only["engine_profile"]
    assert prof["rows"] == 1 and prof["steps"] >= 5
    ms = prof["ms"]
    assert ms["linear"] > 0 and ms["sampling"] > 0
    assert all(v <= ms["total"] for v in ms.values())  # each phase is part of its step


async def test_a_load_whose_prompts_fill_the_context_window_says_so(tiny_model_dir: Path) -> None:
    """The tiny model's window is 512 tokens: prompts of about 400 of them leave room for fewer tokens than
    max_tokens asks, so every reply ends at the window, and the report says "context", not max_tokens."""
    from server.load.cli import _load_engine

    cfg = LoadConfig(
        url="engine-only",
        users=1,
        requests=2,
        turns=1,
        temperature=0.0,
        max_tokens=Dist("fixed", 300),
        prompt_words=Dist("fixed", 85),  # this tokenizer's words come to about 400 tokens
        seed=11,
    )
    rep = await run(cfg, progress=False, engine=_load_engine(str(tiny_model_dir), None))
    _check_counts(rep)
    rq = rep["requests"]
    assert rq["finish_reasons"] == {"length": 2} and rq["length_reasons"] == {"context": 2}, rq
    assert rep["tokens"]["prompt"] + rep["tokens"]["completion"] == 2 * 512


@pytest.mark.parametrize(
    "args, message",
    [
        (["--engine-only", "ws://127.0.0.1:1/v1/ws"], "not both"),
        ([], "give the server's URL"),
        (["--engine-only", "--idle", "5"], "no --idle"),
        (["ws://127.0.0.1:1/v1/ws", "--threads", "1"], "go with --engine-only"),
        (["http://127.0.0.1:1/v1", "--api", "openai-ws", "--drop-rate", "0.5"], "no --idle, --drop-rate"),
        (["ws://127.0.0.1:1/v1/ws", "--requests", "0"], "--requests: expected at least 1"),
        (["ws://127.0.0.1:1/v1/ws", "--duration", "0"], "--duration: expected at least 0.001 and at most"),
    ],
)
def test_engine_only_flags_are_checked(args: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "server.cli", "load", *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr


async def test_load_api_openai_runs_the_same_workload_over_http(served: ServeProcess) -> None:
    """``--api openai`` against tokenwire's own HTTP API: the same seeded prompts as over the WebSocket
    (equal prompt tokens, request by request), a consistent report, and measured SSE bytes per token."""

    def cfg(**kw: Any) -> LoadConfig:
        return LoadConfig(users=1, requests=4, max_tokens=Dist("uniform", 8, 16), seed=3, **kw)

    ws = await run(cfg(url=served.url), progress=False)
    http = served.url.replace("ws://", "http://").removesuffix("/ws")
    rep = await run(cfg(url=http, api="openai"), progress=False)
    rq, tk = rep["requests"], rep["tokens"]
    assert rq["issued"] == rq["ok"] == 4 and rq["failed"] == 0, rq["failed_by_code"]
    assert tk["completion"] == tk["streamed_live"] > 0
    assert tk["prompt"] == ws["tokens"]["prompt"] > 0
    assert rep["ttft_ms"]["n"] == 4 and rep["config"]["api"] == "openai"
    sse = rep["wire"]["measured"]["sse"]
    assert sse["tokens"] > 0 and sse["wire_per_token"] > ws["wire"]["measured"]["msgpack"]["wire_per_token"]


async def test_load_api_openai_ws_runs_the_same_workload_over_the_responses_websocket(
    served: ServeProcess,
) -> None:
    """``--api openai-ws`` (``response.create`` on ``/v1/responses`` upgraded, later turns continued by
    ``previous_response_id``): the same conversations as ``--api openai`` sends over HTTP with the whole
    history. Greedy on one user, so both runs generate the same texts: equal prompt and completion tokens
    over two turns. A complete report (tokens/s, TTFT, inter-token latency, bytes) and every request ok."""

    def cfg(**kw: Any) -> LoadConfig:
        return LoadConfig(
            users=1, turns=2, requests=4, max_tokens=Dist("uniform", 8, 16), temperature=0.0, seed=5, **kw
        )

    http = served.url.replace("ws://", "http://").removesuffix("/ws")
    ref = await run(cfg(url=http, api="openai"), progress=False)
    rep = await run(cfg(url=http, api="openai-ws"), progress=False)
    rq, tk = rep["requests"], rep["tokens"]
    assert rq["issued"] == rq["ok"] == 4 and rq["failed"] == 0, rq["failed_by_code"]
    assert sum(rq["finish_reasons"].values()) == 4 and set(rq["finish_reasons"]) <= {"stop", "length"}
    assert set(rq["length_reasons"]) <= {"unsaid"}  # the Responses API has no length reason to say
    assert tk["completion"] == tk["streamed_live"] > 0 and tk["per_s"] > 0
    assert (tk["prompt"], tk["completion"]) == (ref["tokens"]["prompt"], ref["tokens"]["completion"])
    assert rep["ttft_ms"]["n"] == 4 and rep["itl_ms"]["n"] > 0 and rep["latency_ms"]["n"] == 4
    assert rep["config"]["api"] == "openai-ws" and rep["servers"]
    measured = rep["wire"]["measured"]["openai-ws"]
    assert 0 < measured["tokens"] <= tk["streamed_live"] and measured["wire_per_token"] > 0


async def test_load_system_words_sends_one_app_prompt_through_every_door(
    served: ServeProcess, tiny_model_dir: Path
) -> None:
    """``--system-words``: every conversation opens with the run's one fixed system prompt, whichever door
    carries it (messages mode over the WebSocket, the HTTP history, the Responses ``instructions``, the
    engine itself). Greedy on one user over two turns, so runs with the same default penalties see the
    same prompts (the WebSocket's and the engine's, SPEC §5; the two OpenAI doors', §15): equal prompt and
    completion tokens. The usage's ``cached_tokens`` reaches the report: second turns reuse their first."""
    from server.load.cli import _load_engine

    def cfg(url: str, **kw: Any) -> LoadConfig:
        return LoadConfig(
            url=url,
            users=1,
            turns=2,
            requests=4,
            temperature=0.0,
            max_tokens=Dist("uniform", 4, 12),
            prompt_words=Dist("uniform", 4, 12),
            system_words=30,
            seed=11,
            **kw,
        )

    http = served.url.replace("ws://", "http://").removesuffix("/ws")
    engine = _load_engine(str(tiny_model_dir), None)
    reps = {
        "tokenwire": await run(cfg(served.url), progress=False),
        "engine-only": await run(cfg("engine-only"), progress=False, engine=engine),
        "openai": await run(cfg(http, api="openai"), progress=False),
        "openai-ws": await run(cfg(http, api="openai-ws"), progress=False),
    }
    for name, rep in reps.items():
        assert rep["requests"]["ok"] == 4, (name, rep["requests"])
        assert rep["config"]["system_words"] == 30
        assert rep["tokens"]["prompt"] >= 4 * 30, name  # every request carried the 30-word system prompt
    _check_counts(reps["tokenwire"])
    for a, b in (("tokenwire", "engine-only"), ("openai", "openai-ws")):
        pair = [(reps[n]["tokens"]["prompt"], reps[n]["tokens"]["completion"]) for n in (a, b)]
        assert pair[0] == pair[1], (a, b, pair)
    for name in ("tokenwire", "engine-only"):  # a session each: the second turn reuses the first
        assert 0 < reps[name]["tokens"]["prompt_cached"] < reps[name]["tokens"]["prompt"], name


async def test_keyless_callers_reuse_their_turns_only_with_a_prompt_cache_key(served: ServeProcess) -> None:
    """``--keyless``: no Authorization, so every conversation is the server's one anonymous owner, whose
    callers are strangers to each other: a second turn reuses no more than the chat template's opening.
    With ``--prompt-cache-key`` each conversation names itself, and its second turn reuses its first (the
    system prompt and more), on both OpenAI doors. Greedy, one user: the same texts either way over chat
    completions (which the load tool keeps out of the response cache); the Responses runs take other
    seeds, so that no answer comes from that cache (nothing then is computed at all)."""
    http = served.url.replace("ws://", "http://").removesuffix("/ws")

    def cfg(**kw: Any) -> LoadConfig:
        return LoadConfig(
            url=http,
            users=1,
            turns=2,
            requests=4,
            temperature=0.0,
            max_tokens=Dist("uniform", 4, 12),
            prompt_words=Dist("uniform", 4, 12),
            system_words=40,
            keyless=True,
            **kw,
        )

    for api, seeds in (("openai", (17, 17)), ("openai-ws", (18, 19))):
        plain = await run(cfg(api=api, seed=seeds[0]), progress=False)
        keyed = await run(cfg(api=api, seed=seeds[1], prompt_cache_key=True), progress=False)
        for rep in (plain, keyed):
            assert rep["requests"]["ok"] == 4, (api, rep["requests"])
            assert rep["tokens"]["prompt_cached"] < rep["tokens"]["prompt"] // 2, api  # first turns computed
        assert keyed["config"]["prompt_cache_key"] and keyed["config"]["keyless"]
        tk, ref = keyed["tokens"], plain["tokens"]
        if seeds[0] == seeds[1]:
            assert (tk["prompt"], tk["completion"]) == (ref["prompt"], ref["completion"]), api
        # Two second turns, each reusing at least its 40-word system prompt; without keys far less.
        assert tk["prompt_cached"] >= 2 * 40, (api, tk)
        assert ref["prompt_cached"] < tk["prompt_cached"] // 4, (api, ref, tk)
    with pytest.raises(ValueError, match="keyless"):
        cfg(api="tokenwire")
    with pytest.raises(ValueError, match="--token"):
        cfg(api="openai", token="t")
