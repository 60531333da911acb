"""A checkpoint's own 4-bit weights (engine/int4.py): found only where every value lies on a Q4_1 grid,
computed as the float weights are, read only by decode steps of at most the measured number of rows, and
only when serving bf16 on CPU."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
import torch

from server.bench import floor as fl
from server.bench.tiny_model import q4_1_grid
from server.engine import dtype as dtype_mod
from server.engine import int4, llama
from server.engine.api import SamplingParams
from server.engine.model import load_model, may_hold_4bit
from server.engine.runner import Runner
from tests.engine.test_runner import PROMPTS, Req, assert_matches, chat, drive, generate


def _grid(n: int, k: int, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return q4_1_grid(torch.randn(n, k) * 0.05)


def test_exact_finds_a_q4_1_grid_and_nothing_else() -> None:
    w = _grid(64, 96)
    form = int4.exact(w)
    assert form is not None
    q, scale, low = form
    assert q.dtype == torch.uint8 and int(q.max()) == 15 and int(q.min()) == 0
    assert scale.shape == low.shape == (64, 3)
    back = low.repeat_interleave(32, 1) + q.float() * scale.repeat_interleave(32, 1)
    torch.testing.assert_close(back, w, rtol=0, atol=1e-6)
    off = w.clone()
    off[3, 40] += 0.01 * float(scale[3, 1])  # one value a hundredth of a step off its grid
    assert int4.exact(off) is None
    assert int4.exact(torch.randn(64, 96)) is None  # plain float weights: never quantised here
    assert int4.exact(w.bfloat16()) is None  # only the float32 load holds the grid exactly
    assert int4.exact(_grid(64, 96)[:, :80]) is None  # inputs not a whole number of groups


def test_exact_finds_a_grid_made_as_gguf_makes_it() -> None:
    # A Q4_1 block stores its scale d and minimum m in float16; dequantising computes q * d + m in float32.
    torch.manual_seed(3)
    n, k = 48, 64
    q = torch.randint(0, 16, (n, k // 32, 32)).float()
    q[..., 0], q[..., 1] = 0, 15  # the quantiser's own minimum and maximum
    d = (torch.rand(n, k // 32, 1) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(n, k // 32, 1) * 0.3).half().float()
    w = (q * d + m).reshape(n, k)
    form = int4.exact(w)
    assert form is not None
    back = form[2].repeat_interleave(32, 1) + form[0].float() * form[1].repeat_interleave(32, 1)
    torch.testing.assert_close(back, w, rtol=0, atol=1e-6)
    assert torch.equal(form[0].reshape(n, k // 32, 32).float(), q)


def test_a_layer_with_a_bias_or_an_odd_width_keeps_its_plain_gemms() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    for extra in ({"attention_bias": True}, {"intermediate_size": 40}):
        torch.manual_seed(0)
        cfg: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
        cfg.update(num_key_value_heads=2, **extra)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, num_hidden_layers=1, **cfg))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".layers." in name and p.dim() == 2 and p.shape[1] % 32 == 0:
                    p.copy_(q4_1_grid(p))
        assert int4.model_layers(model) is None, extra


def test_only_a_float32_llama_checkpoint_is_loaded_in_float32_to_look(tmp_path: Path) -> None:
    def config(**fields: Any) -> Path:
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(fields))
        return folder

    assert may_hold_4bit(config(model_type="llama", torch_dtype="float32"), None)
    assert may_hold_4bit(config(model_type="qwen2", dtype="float32"), 8)
    assert may_hold_4bit(config(model_type="llama"), None)  # no dtype stored: float32 by default
    assert not may_hold_4bit(config(model_type="llama", torch_dtype="float32"), 0)  # turned off
    assert not may_hold_4bit(config(model_type="llama", torch_dtype="bfloat16"), None)
    assert not may_hold_4bit(config(model_type="gpt2", torch_dtype="float32"), None)
    assert not may_hold_4bit(tmp_path / "nowhere", None)


def test_the_4bit_gemm_computes_the_float_weights() -> None:
    a, b = _grid(96, 64, seed=1), _grid(32, 64, seed=2)
    fa, fb = int4.exact(a), int4.exact(b)
    assert fa is not None and fb is not None
    fused = int4.pack([fa, fb]).to(torch.bfloat16)
    assert (fused.out_features, fused.in_features) == (128, 64)
    assert fused.nbytes == 128 * 64 // 2 + 2 * 2 * 128 * 2  # half a byte a weight, two bf16 per group
    x = torch.randn(5, 64)
    want = x @ torch.cat([a, b]).t()
    got = int4.mm(x.bfloat16(), fused).float()
    plain = (x.bfloat16() @ torch.cat([a, b]).bfloat16().t()).float()  # what the packed bf16 path does
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= max(2 * float((plain - want).abs().max()), 0.02 * scale)


@pytest.fixture
def mm_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of every 4-bit GEMM (int4.mm) run while the test lasts."""
    calls: list[int] = []
    real = int4.mm

    def spy(x: torch.Tensor, w: int4.Int4) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, w)

    monkeypatch.setattr(int4, "mm", spy)
    return calls


@pytest.mark.parametrize(
    ("asked", "serves"),
    [("bfloat16", torch.bfloat16), ("auto", torch.float32)],  # auto: the tiny model is too small for bf16
)
def test_a_named_row_count_runs_small_steps_on_4_bits(
    four_bit_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    mm_calls: list[int],
    asked: str,
    serves: torch.dtype,
) -> None:
    monkeypatch.setenv("TOKENWIRE_INT4_ROWS", "3")
    m = load_model(four_bit_model_dir, dtype=asked)
    assert m.dtype == serves
    assert m.int4 is not None and m.int4_rows == 3 and "TOKENWIRE_INT4_ROWS" in m.int4_note
    shape = llama.shape_of(m.model)
    fours = llama.weights_of(m.model, 64, int4=m.int4, int4_rows=m.int4_rows)
    plain = llama.weights_of(m.model, 64)
    for rows, on in [(1, True), (3, True), (4, False)]:
        mm_calls.clear()
        logits = {}
        for name, w in (("int4", fours), ("plain", plain)):
            cache = llama.Cache(shape, [(rows, 64)], dtype=serves, device="cpu")
            torch.manual_seed(rows)
            ids = torch.randint(3, shape.vocab, (rows,))
            layout = llama.StepLayout(
                ids=ids,
                positions=torch.zeros(rows, dtype=torch.long),
                write_rows=torch.tensor([r for s in range(rows) for r in cache.rows_of(0, s, 0)]),
                decode=[
                    llama.DecodeGroup(
                        pool=0,
                        tok_lo=0,
                        tok_hi=rows,
                        n_slots=rows,
                        length=1,
                        mask=torch.zeros(rows, 1, 1, 1, dtype=serves),
                        rows=None,
                    )
                ],
                prefill=[],
                logits_at=torch.arange(rows),
            )
            with torch.inference_mode():
                logits[name] = llama.forward(w, shape, cache, layout)
            assert logits[name].dtype == torch.float32
        # 4 GEMMs a layer on 4 bits at up to 3 rows; none past them (the LM head never: not 4-bit)
        assert mm_calls == ([rows] * 4 * shape.n_layers if on else [])
        spread = float(logits["plain"].abs().max())
        assert float((logits["int4"] - logits["plain"]).abs().max()) <= 0.05 * spread
        assert torch.equal(logits["int4"].argmax(-1), logits["plain"].argmax(-1))


def test_the_runner_serves_on_4_bits_with_one_copy(
    four_bit_model_dir: Path, monkeypatch: pytest.MonkeyPatch, mm_calls: list[int]
) -> None:
    monkeypatch.setenv("TOKENWIRE_INT4_ROWS", "4")
    ref, m = (
        load_model(four_bit_model_dir, dtype="bfloat16"),
        load_model(four_bit_model_dir, dtype="bfloat16"),
    )
    assert m.int4 is not None
    pools = ((4, 256),)
    runner = Runner(m.model, pools, device="cpu", dtype=m.dtype, keep_plain=False, int4=m.int4, int4_rows=4)
    runner.weights, _ = llama.release_model_linears(m.model, runner.weights)
    assert runner.weights.int4_rows == 4
    assert all(L.qkv.int4 is not None and L.down.int4 is not None for L in runner.weights.layers)
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    prompts = [chat(ref, p) for p in PROMPTS[:3]]
    got = drive(
        m, [Req(f"r{i}", p, greedy, join=4 * i) for i, p in enumerate(prompts)], pools=pools, runner=runner
    )
    assert mm_calls and max(mm_calls) <= 4  # steps of at most 4 tokens ran on 4 bits, the rest did not
    for i, p in enumerate(prompts):
        # The same tokens as transformers on the bf16 weights, up to a near tie in bf16.
        assert_matches(ref, p, got.tokens[f"r{i}"], generate(ref, p, 16), bf16_steps=8)


def test_off_unless_a_4bit_checkpoint_runs_on_cpu_and_float32_was_not_asked_for(
    four_bit_model_dir: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENWIRE_INT4_ROWS", "4")
    f32 = load_model(four_bit_model_dir, dtype="float32")
    assert f32.int4 is None and f32.int4_rows == 0 and "float32 as asked" in f32.int4_note
    monkeypatch.delenv("TOKENWIRE_INT4_ROWS")
    auto = load_model(four_bit_model_dir)  # auto serves float32 (too small for bf16), and too small to time
    assert auto.dtype == torch.float32 and auto.int4 is None
    assert "too small to measure" in auto.int4_note
    monkeypatch.setenv("TOKENWIRE_INT4_ROWS", "4")
    plain = load_model(tiny_model_dir, dtype="bfloat16")
    assert plain.int4 is None and "not exactly 4-bit" in plain.int4_note
    for zero in ("0", "00"):
        monkeypatch.setenv("TOKENWIRE_INT4_ROWS", zero)
        off = load_model(four_bit_model_dir, dtype="bfloat16")
        assert off.int4 is None and off.int4_rows == 0 and "TOKENWIRE_INT4_ROWS=0" in off.int4_note
    for bad in ("many", "-1", "4097", "٣", "AUTO", " auto"):
        monkeypatch.setenv("TOKENWIRE_INT4_ROWS", bad)
        refused = f"TOKENWIRE_INT4_ROWS={bad}: a number of rows, 0 to 4096, or auto"
        with pytest.raises(ValueError, match=refused):
            load_model(tiny_model_dir)  # refused whatever the model: a typo is never ignored
    monkeypatch.delenv("TOKENWIRE_INT4_ROWS")
    small = load_model(four_bit_model_dir, dtype="bfloat16")  # 4-bit, but too small to be worth timing
    assert small.int4 is None and "too small" in small.int4_note


@pytest.fixture
def timed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[list[float]], list[str]]:
    """Makes the 4-bit measurement see the given step times ([plain, int4] per row count, in turn) and
    returns the log of what was timed; the tiny model counts as big enough, choices go to this test's
    own cache folder."""
    monkeypatch.setattr(dtype_mod, "SMALL_MODEL_PARAMS", 0)
    monkeypatch.setenv("TOKENWIRE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TOKENWIRE_INT4_ROWS", raising=False)
    monkeypatch.delenv("TOKENWIRE_DTYPE_REMEASURE", raising=False)
    monkeypatch.setenv("TOKENWIRE_DECODE_KERNEL", "sdpa")
    log: list[str] = []

    def install(seconds: list[float]) -> list[str]:
        pairs = iter(zip(seconds[::2], seconds[1::2], strict=True))

        def fake(steps: list[Any]) -> list[float]:
            assert len(steps) == 2  # the packed step and the 4-bit step, in turn
            plain, four = next(pairs)
            log.append(f"{plain}/{four}")
            steps[0](), steps[1]()  # both really run, once each
            return [plain, four]

        monkeypatch.setattr(dtype_mod, "_interleaved", fake)
        return log

    return install


@pytest.fixture
def grid_searches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry for every search of a model's layers for the 4-bit grid (int4.model_layers)."""
    found: list[int] = []
    real = int4.model_layers
    monkeypatch.setattr(int4, "model_layers", lambda model: found.append(1) or real(model))
    return found


@pytest.mark.parametrize(
    ("seconds", "rows"),
    [
        ([1.0, 0.5, 1.0, 0.6, 1.0, 0.8, 1.0, 0.97, 1.0, 1.2], 4),  # wins up to 4 rows
        ([1.0, 0.5, 1.0, 0.97, 1.0, 0.5, 1.0, 0.5, 1.0, 0.5], 1),  # a near tie at 2 ends it
        ([1.0, 0.96, 1.0, 0.5, 1.0, 0.5, 1.0, 0.5, 1.0, 0.5], 0),  # not clearly faster at one row
    ],
    ids=["up-to-4", "stops-at-the-first-loss", "off"],
)
def test_the_row_count_is_measured_then_remembered(
    four_bit_model_dir: Path,
    grid_searches: list[int],
    timed: Callable[[list[float]], list[str]],
    seconds: list[float],
    rows: int,
) -> None:
    assert dtype_mod.INT4_ROWS == (1, 2, 4, 8, 16)
    log = timed(seconds)
    m = load_model(four_bit_model_dir, dtype="bfloat16")
    assert len(log) == len(dtype_mod.INT4_ROWS)
    assert m.int4_rows == rows and (m.int4 is not None) == bool(rows)
    assert "measured now" in m.int4_note
    before = len(grid_searches)
    again = load_model(four_bit_model_dir, dtype="bfloat16")
    assert len(log) == len(dtype_mod.INT4_ROWS)  # nothing timed the second time
    assert again.int4_rows == rows
    if rows:
        assert "remembered" in again.int4_note and grid_searches[before:] == [1]
    else:  # measured no faster: a later start does not even look for the grid
        assert "measured them no faster" in again.int4_note and grid_searches[before:] == []


@pytest.mark.parametrize(
    ("seconds", "rows"),
    [([1.0, 0.5, 1.0, 0.6, 1.0, 0.8, 1.0, 0.97, 1.0, 1.2], 4), ([1.0, 0.96] + [1.0, 0.5] * 4, 0)],
    ids=["up-to-4", "off"],
)
def test_the_row_count_is_measured_in_float32_too(
    four_bit_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    grid_searches: list[int],
    timed: Callable[[list[float]], list[str]],
    seconds: list[float],
    rows: int,
) -> None:
    """Where --dtype auto serves float32, the 4-bit copies are measured and kept as in bf16 (since the
    lite serving load made room for them under 1 GB); TOKENWIRE_INT4_ROWS=auto means the same; float32
    asked for keeps float32's numbers."""
    monkeypatch.setattr(dtype_mod, "interleaved_seconds", lambda *models: [1.0, 0.95])  # a near tie: fp32
    log = timed(seconds)
    with structlog.testing.capture_logs() as logs:
        m = load_model(four_bit_model_dir)  # unset
    assert m.dtype == torch.float32 and len(log) == len(dtype_mod.INT4_ROWS)  # measured as bf16 is
    assert m.int4_rows == rows and (m.int4 is not None) == bool(rows) and "measured now" in m.int4_note
    assert "packed float32 weights" in m.int4_note
    # The operator reads the choice in the start's log.
    assert [e["four_bit"] for e in logs if e["event"] == "model.loaded"] == [m.int4_note]
    monkeypatch.setenv("TOKENWIRE_INT4_ROWS", "auto")  # an older setting: the same as unset
    again = load_model(four_bit_model_dir)
    assert len(log) == len(dtype_mod.INT4_ROWS) and again.int4_rows == rows  # remembered, not timed again
    # Measured no faster: a later start does not look for the grid; faster: it does, once.
    assert grid_searches == ([1, 1] if rows else [1])
    asked = load_model(four_bit_model_dir, dtype="float32")  # float32 as asked keeps float32's numbers
    assert asked.int4 is None and "float32 as asked" in asked.int4_note


def test_the_roofline_counts_the_4bit_bytes_at_small_rows(
    four_bit_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENWIRE_INT4_ROWS", "2")
    m = load_model(four_bit_model_dir, dtype="bfloat16")
    w = llama.weights_of(m.model, 8, int4=m.int4, int4_rows=m.int4_rows)
    full, small = fl.weight_bytes(w, 3), fl.weight_bytes(w, 2)
    head = w.lm_head.in_features * w.lm_head.out_features * 2
    layers = sum(x.in_features * x.out_features for L in w.layers for x in (L.qkv, L.o, L.gate_up, L.down))
    assert full == head + 2 * layers
    # half a byte a weight, and a bf16 scale and zero per 32 weights: 5/8 of a byte, not 2
    assert small == head + layers * 5 // 8
