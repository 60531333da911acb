"""The batched runner against transformers: greedy tokens from mixed batches (different lengths, joining
and leaving, chunked, moved between pools, preempted) equal model.generate's for each request alone —
except that at a first divergence, if any, the two top logits must be a near tie."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from server.engine.api import SamplingParams
from server.engine.engine import public_prefix
from server.engine.model import LoadedModel, ModelNotFound, load_model
from server.engine.runner import Runner
from server.engine.scheduler import Scheduler, SchedulerConfig

TIE = 1e-3


# float32, not the dtype --dtype auto would measure as faster: these tests hold the engine's greedy tokens
# to transformers' own, and only float32 is exact enough for that on every CPU. In bfloat16 the engine's
# oneDNN kernels and transformers' round differently, and a greedy walk parts where the top two logits
# are a few bf16 steps apart (0.25 apart at token 19 of one SmolLM2 prompt on an AVX512-BF16 EPYC).
@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> LoadedModel:
    return load_model(tiny_model_dir, dtype="float32")


@pytest.fixture(scope="module")
def smol() -> LoadedModel:
    try:
        return load_model(dtype="float32")
    except ModelNotFound as exc:
        pytest.skip(str(exc))


@dataclass
class Req:
    key: str
    prompt: list[int]
    params: SamplingParams
    join: int = 0  # the step at which it arrives
    session: str = ""


@dataclass
class Drive:
    tokens: dict[str, list[int]]
    sched: Scheduler
    max_batch: int  # most sequences in one step


def drive(
    m: LoadedModel,
    reqs: Sequence[Req],
    *,
    pools: tuple[tuple[int, int], ...],
    prefill_tokens: int = 64,
    max_running: int = 8,
    reuse: bool = True,
    runner: Runner | None = None,
    share: int = 0,
) -> Drive:
    cfg = SchedulerConfig(
        pools=pools,
        max_running=max_running,
        prefill_tokens=prefill_tokens,
        eos_ids=m.eos_ids,
        prefix_reuse=reuse,
        share_min_tokens=share,
    )
    sched = Scheduler(cfg, m.decode)
    runner = runner or Runner(m.model, pools, device=m.device, dtype=m.dtype)
    tokens: dict[str, list[int]] = {r.key: [] for r in reqs}
    pending = {r.key for r in reqs}
    most = 0
    for step in range(10_000):
        for r in reqs:
            if r.join == step:
                sched.add(r.key, r.prompt, r.params, session=r.session, user="u")
        if not sched.has_work():
            if all(r.join < step for r in reqs):
                break
            continue
        batch = sched.schedule()
        most = max(most, len(batch.work))
        for o in sched.postprocess(batch, runner.step(batch)):
            tokens[o.key].extend(o.token_ids)
            if o.finish:
                pending.discard(o.key)
        sched.table.check()
    assert not pending
    return Drive(tokens, sched, most)


def generate(m: LoadedModel, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=m.device)
    out = m.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    ref: list[int] = out[0, len(prompt) :].tolist()
    eos = next((i for i, t in enumerate(ref) if t in m.eos_ids), None)
    return ref if eos is None else ref[: eos + 1]


def assert_matches(
    m: LoadedModel, prompt: list[int], got: list[int], ref: list[int], *, bf16_steps: int = 0
) -> None:
    """``got`` is ``ref`` up to the first near tie, where either may win: a top-2 gap under ``TIE`` in
    float32, or (``bf16_steps``) under that many bfloat16 steps at the top logit's magnitude."""
    for i, (a, b) in enumerate(zip(got, ref, strict=False)):
        if a != b:
            with torch.inference_mode():
                logits = m.model(input_ids=torch.tensor([prompt + ref[:i]], device=m.device)).logits
            top = logits[0, -1].float().topk(2).values
            gap = float(top[0] - top[1])
            tie = TIE
            if bf16_steps:
                tie = bf16_steps * 2.0 ** (math.floor(math.log2(abs(float(top[0])) or 1.0)) - 7)
            assert gap < tie, f"token {i}: {a} != {b} and the top-2 logit gap is {gap:.2e}, not a near tie"
            return
    assert len(got) == len(ref), f"{len(got)} tokens, generate gave {len(ref)}"


def chat(m: LoadedModel, text: str) -> list[int]:
    return m.encode_chat([{"role": "user", "content": text}])


PROMPTS = [
    "Hello",
    "The capital of France is",
    "tokenwire streams tokens over WebSockets to browsers and phones that reconnect. " * 3,
    "naïve café 東京 🚀 résumé",
    "How are you today? I am fine, thank you.",
    "The quick brown fox jumps over the lazy dog.",
]


@pytest.mark.parametrize("kernel", ["sdpa", "kq"])
def test_greedy_mixed_batches_match_generate_on_a_tiny_llama(tiny: LoadedModel, kernel: str) -> None:
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    reqs = [Req(f"r{i}", chat(tiny, p), greedy, join=(0, 0, 1, 3, 7, 12)[i]) for i, p in enumerate(PROMPTS)]
    reqs.append(Req("raw", [5, 9, 13, 200, 7], SamplingParams(max_tokens=25, temperature=0.0), join=4))
    # Short slots of 48 tokens and only two long ones: sequences chunk (16-token budget), move up to
    # the long pool as they grow, and preempt one another.
    runner = Runner(
        tiny.model, ((5, 48), (2, 256)), device=tiny.device, dtype=tiny.dtype, decode_kernel=kernel
    )
    run = drive(tiny, reqs, pools=((5, 48), (2, 256)), prefill_tokens=16, max_running=5, runner=runner)
    assert run.sched.preemptions > 0 and run.max_batch >= 4
    for r in reqs:
        assert_matches(tiny, r.prompt, run.tokens[r.key], generate(tiny, r.prompt, r.params.max_tokens))


def test_prompts_that_start_alike_copy_that_kv_and_still_match_generate(peaky_model_dir: Path) -> None:
    """Shared prompt starts (SchedulerConfig.share_min_tokens): every chat prompt opens with the template's
    system prompt, and some go on alike for longer; the copies land in slots that then chunk, move up a
    pool and get preempted, and every reply is still transformers' own."""
    m = load_model(peaky_model_dir, dtype="float32")  # its text depends on the prompt, unlike tiny's
    greedy = SamplingParams(max_tokens=30, temperature=0.0)
    texts = [*PROMPTS, "The capital of France is Paris. And the capital of Spain is", "The capital of Fr"]
    joins = (0, 1, 2, 9, 5, 8, 3, 12)
    reqs = [Req(f"r{i}", chat(m, p), greedy, join=joins[i]) for i, p in enumerate(texts)]
    run = drive(m, reqs, pools=((5, 48), (2, 256)), prefill_tokens=16, max_running=5, share=8)
    assert run.sched.preemptions > 0
    # The two France prompts: the later one (step 3) copies all it has in common with the earlier one
    # (step 1, its prompt fed by then) past the template's opening.
    a, b = reqs[1].prompt, reqs[6].prompt
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert common > len(public_prefix(m)) and common >= 8
    assert run.sched.shared_tokens >= common
    for r in reqs:
        assert_matches(m, r.prompt, run.tokens[r.key], generate(m, r.prompt, r.params.max_tokens))


@pytest.mark.slow
def test_greedy_mixed_batches_match_generate_on_smollm2(smol: LoadedModel) -> None:
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    reqs = [Req(f"r{i}", chat(smol, p), greedy, join=(0, 0, 2, 3, 6, 9)[i]) for i, p in enumerate(PROMPTS)]
    run = drive(smol, reqs, pools=((6, 64), (2, 512)), prefill_tokens=48, max_running=6)
    assert run.max_batch >= 4
    for r in reqs:
        assert_matches(smol, r.prompt, run.tokens[r.key], generate(smol, r.prompt, r.params.max_tokens))


@pytest.fixture(scope="module")
def smol_bf16() -> tuple[LoadedModel, dict[str, list[int]]]:
    """SmolLM2 in bfloat16, loaded once for the module, and a cache of its generate references."""
    try:
        return load_model(dtype="bfloat16"), {}
    except ModelNotFound as exc:
        pytest.skip(str(exc))


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["sdpa", "kq"])
def test_greedy_mixed_batches_follow_generate_on_smollm2_in_bfloat16(
    kernel: str, smol_bf16: tuple[LoadedModel, dict[str, list[int]]]
) -> None:
    """The dtype --dtype auto serves on CPUs with AVX512-BF16 or AMX: the same batches, held to
    transformers' own bf16 up to ties of a few bf16 steps (a wrong cache or mask parts far wider), with
    either decode kernel the engine may measure as faster there."""
    smol, refs = smol_bf16
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    reqs = [Req(f"r{i}", chat(smol, p), greedy, join=(0, 0, 2, 3, 6, 9)[i]) for i, p in enumerate(PROMPTS)]
    pools = ((6, 64), (2, 512))
    runner = Runner(smol.model, pools, device=smol.device, dtype=smol.dtype, decode_kernel=kernel)
    run = drive(smol, reqs, pools=pools, prefill_tokens=48, max_running=6, runner=runner)
    for r in reqs:
        if r.key not in refs:  # transformers' own generate, the same for both kernels: computed once
            refs[r.key] = generate(smol, r.prompt, r.params.max_tokens)
        assert_matches(smol, r.prompt, run.tokens[r.key], refs[r.key], bf16_steps=8)


def test_same_seed_same_text_whatever_the_batch_mates(tiny: LoadedModel) -> None:
    params = SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, top_k=50, seed=7, ignore_eos=True)
    me = Req("me", chat(tiny, "Hello, how are you?"), params, join=2)
    alone = drive(tiny, [me], pools=((4, 256),))
    mates = [
        Req(f"m{i}", chat(tiny, p), SamplingParams(max_tokens=20 + i, temperature=1.0, seed=i), join=i)
        for i, p in enumerate(PROMPTS[:4])
    ]
    crowded = drive(tiny, [me, *mates], pools=((3, 40), (2, 256)), prefill_tokens=8, max_running=4)
    assert crowded.tokens["me"] == alone.tokens["me"]
    assert len(alone.tokens["me"]) == 30
    other_seed = Req("me", me.prompt, SamplingParams(max_tokens=30, temperature=0.9, seed=8, ignore_eos=True))
    assert drive(tiny, [other_seed], pools=((4, 256),)).tokens["me"] != alone.tokens["me"]


def two_turns(m: LoadedModel, *, reuse: bool, pools: tuple[tuple[int, int], ...]) -> tuple[list[int], int]:
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    runner = Runner(m.model, pools, device=m.device, dtype=m.dtype)
    msgs = [{"role": "user", "content": "The capital of France is"}]
    p1 = m.encode_chat(msgs)
    first = drive(m, [Req("t1", p1, greedy, session="S")], pools=pools, reuse=reuse, runner=runner)
    reply = m.decode(first.tokens["t1"])
    msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And of Japan?"}]
    p2 = m.encode_chat(msgs)
    # The same scheduler must serve turn 2 for its cached prefix to exist: drive it by hand.
    sched = first.sched
    seq = sched.add("t2", p2, greedy, session="S")
    out: list[int] = []
    while sched.has_work():
        batch = sched.schedule()
        for o in sched.postprocess(batch, runner.step(batch)):
            out.extend(o.token_ids)
    assert_matches(m, p2, out, generate(m, p2, 20))
    return out, seq.reused


def test_session_prefix_reuse_gives_the_same_tokens(tiny: LoadedModel) -> None:
    pools = ((4, 256),)
    with_reuse, reused = two_turns(tiny, reuse=True, pools=pools)
    without, none = two_turns(tiny, reuse=False, pools=pools)
    assert reused > 10 and none == 0
    assert with_reuse == without


@pytest.mark.slow
def test_session_prefix_reuse_gives_the_same_tokens_on_smollm2(smol: LoadedModel) -> None:
    pools = ((2, 64), (2, 512))  # turn 2 outgrows the short slot it was cached in
    with_reuse, reused = two_turns(smol, reuse=True, pools=pools)
    without, _ = two_turns(smol, reuse=False, pools=pools)
    assert reused > 30
    assert with_reuse == without


def test_a_model_that_is_not_llama_family_is_refused(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64))
    with pytest.raises(ValueError, match="Llama-family"):
        Runner(model, ((2, 32),), device="cpu", dtype=torch.float32)


def test_greedy_rows_argmax_on_the_device_give_the_same_tokens(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU the greedy rows take their argmax there, after their penalties, and only the sampled rows'
    logits go to the host (Runner.argmax_on_device). Forced on here, on CPU, it must draw every token the
    all-on-the-host path draws, in a batch that mixes greedy, penalised greedy and sampled rows."""
    pools = ((3, 64), (2, 256))
    sampled = SamplingParams(max_tokens=22, temperature=0.8, seed=3)
    reqs = [
        Req("greedy", chat(tiny, PROMPTS[0]), SamplingParams(max_tokens=24, ignore_eos=True)),
        Req(
            "penalised",
            chat(tiny, PROMPTS[1]),
            SamplingParams(max_tokens=20, temperature=0.0, frequency_penalty=0.5, ignore_eos=True),
            join=1,
        ),
        Req("sampled", chat(tiny, PROMPTS[4]), sampled, join=2),
        Req("greedy2", chat(tiny, PROMPTS[5]), SamplingParams(max_tokens=18, temperature=0.0), join=3),
    ]
    host = drive(tiny, reqs, pools=pools, prefill_tokens=16, max_running=4)

    import server.engine.runner as runner_mod

    drawn_rows: list[int] = []
    real_sample = runner_mod.sample

    def counting(logits: torch.Tensor, params: Sequence[SamplingParams], offsets: Sequence[int]) -> list[int]:
        assert all(p.temperature > 0.0 for p in params)
        drawn_rows.append(len(params))
        return real_sample(logits, params, offsets)

    monkeypatch.setattr(runner_mod, "sample", counting)
    runner = Runner(tiny.model, pools, device=tiny.device, dtype=tiny.dtype)
    runner.argmax_on_device = True
    device = drive(tiny, reqs, pools=pools, prefill_tokens=16, max_running=4, runner=runner)
    assert device.tokens == host.tokens
    assert all(len(device.tokens[r.key]) > 0 for r in reqs)
    # Only the sampled row reached the host, in the steps that drew for it.
    assert drawn_rows and max(drawn_rows) == 1
