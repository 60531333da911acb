"""Half the memory: serving keeps one copy of the weights (oneDNN's packed copies, the model's own linear
tensors released, the rest out of the checkpoint's file mapping) and a KV cache whose pages become
resident only when written. Same tokens as the engine that keeps every copy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from server.engine import llama
from server.engine.api import SamplingParams
from server.engine.model import load_model
from server.engine.runner import Runner
from tests.engine.test_mapped import _mapping_of
from tests.engine.test_runner import PROMPTS, Req, chat, drive


def _rss_anon_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    pytest.skip("no RssAnon in /proc/self/status")


def _vm_flags(t: torch.Tensor) -> list[str]:
    """VmFlags of the mapping holding the middle of ``t`` (/proc/self/smaps)."""
    addr = t.data_ptr() + t.numel() * t.element_size() // 2
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return []


def test_the_kv_cache_is_zero_and_costs_no_memory_until_written() -> None:
    before = _rss_anon_kib()
    t = llama.zeroed((8, 2, 1 << 20, 16), torch.float32, "cpu")  # 1 GiB
    assert t.shape == (8, 2, 1 << 20, 16) and t.dtype == torch.float32
    assert float(t[3, 1, 12345:12400].abs().sum()) == 0.0  # reading untouched pages: zeros, no memory
    grown = _rss_anon_kib() - before
    assert grown < 64 * 1024, f"a 1 GiB zeroed cache made {grown} KiB resident before any write"
    t[0, 0, :1024].fill_(1.5)
    assert float(t[0, 0, :1024].sum()) == 1.5 * 1024 * 16
    # 4 KiB pages, not huge ones: numpy advises huge pages for large arrays, and then one written KV row
    # made 2 MiB resident.
    if Path("/proc/self/smaps").exists():
        assert "nh" in _vm_flags(t), "the cache's pages may be huge: a write makes 2 MiB resident"
    b = llama.zeroed((4, 6), torch.bfloat16, "cpu")
    assert b.dtype == torch.bfloat16 and b.shape == (4, 6) and not b.any()


def test_one_copy_gives_the_same_tokens_and_releases_the_model_linears(tiny_model_dir: Path) -> None:
    kept, served = load_model(tiny_model_dir), load_model(tiny_model_dir)
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    sampled = SamplingParams(max_tokens=24, temperature=0.9, seed=7)
    reqs = [Req(f"r{i}", chat(kept, p), greedy if i % 2 else sampled, join=i) for i, p in enumerate(PROMPTS)]
    pools = ((4, 48), (2, 256))
    runner = Runner(served.model, pools, device="cpu", dtype=served.dtype, keep_plain=False)
    runner.weights, freed = llama.release_model_linears(served.model, runner.weights)
    if runner.weights.layers[0].qkv.packed is None:
        pytest.skip("oneDNN is not available: nothing is packed, every copy is kept")
    assert freed > 0
    layer = served.model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, llama.ReleasedLinear)
    assert isinstance(layer.mlp.down_proj, llama.ReleasedLinear)
    assert runner.weights.layers[0].qkv.w.device.type == "meta"  # the fused plain copy is gone too
    # What the forward still reads of the model is the model's (moved) tensor, not a stale view.
    assert runner.weights.embed.data_ptr() == served.model.model.embed_tokens.weight.data_ptr()
    # The embedding (tied to the LM head, which lives on packed) is read from the checkpoint file's mapping.
    assert torch.equal(runner.weights.embed, kept.model.model.embed_tokens.weight)
    if Path("/proc/self/maps").exists():
        assert str(tiny_model_dir / "model.safetensors") in _mapping_of(runner.weights.embed)
    with pytest.raises(RuntimeError, match="released"):  # a shell now: an error, never numbers
        served.model(input_ids=torch.tensor([[1, 2, 3]]))

    ref = drive(kept, reqs, pools=pools, prefill_tokens=16, max_running=4)
    got = drive(served, reqs, pools=pools, prefill_tokens=16, max_running=4, runner=runner)
    assert got.tokens == ref.tokens
    assert any(len(v) > 5 for v in got.tokens.values())


def test_without_packed_copies_the_model_reads_views_of_the_fused_weights(tiny_model_dir: Path) -> None:
    # The path a GPU takes (nothing is packed there, and release_model_linears frees nothing): the fused
    # q/k/v and gate/up copies used to sit beside the model's own tensors, two copies of most weights.
    m = load_model(tiny_model_dir, dtype="float32")
    ids = torch.tensor([[1, 5, 9, 14, 3, 7]])
    with torch.no_grad():
        before = m.model(ids).logits
    w = llama.weights_of(m.model, 64, pack=False)
    for layer, ours in zip(m.model.model.layers, w.layers, strict=True):
        a, mlp = layer.self_attn, layer.mlp
        for fused, parts in (
            (ours.qkv.w, (a.q_proj, a.k_proj, a.v_proj)),
            (ours.gate_up.w, (mlp.gate_proj, mlp.up_proj)),
        ):
            storage = fused.untyped_storage().data_ptr()
            assert all(p.weight.untyped_storage().data_ptr() == storage for p in parts)
            assert all(p.weight.is_contiguous() for p in parts)
            assert torch.equal(torch.cat([p.weight for p in parts]), fused)
    with torch.no_grad():
        assert torch.equal(m.model(ids).logits, before)  # the same numbers, one copy of them
