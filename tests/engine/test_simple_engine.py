"""The first engine on a tiny random Llama: greedy equals model.generate, seeds reproduce, cancel works."""

from __future__ import annotations

import queue
from pathlib import Path

import pytest
import torch

from server.engine.api import GenerationRequest, SamplingParams, StepOutput
from server.engine.model import LoadedModel, load_model
from server.engine.simple import SimpleEngine


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> LoadedModel:
    return load_model(tiny_model_dir)


def run_all(engine: SimpleEngine, reqs: list[GenerationRequest]) -> dict[str, list[StepOutput]]:
    q: queue.Queue[list[StepOutput]] = queue.Queue()
    engine.start(q.put)
    for r in reqs:
        engine.submit(r)
    outs: dict[str, list[StepOutput]] = {r.key: [] for r in reqs}
    pending = {r.key for r in reqs}
    try:
        while pending:
            for o in q.get(timeout=60):
                outs[o.key].append(o)
                if o.finish:
                    pending.discard(o.key)
    finally:
        engine.stop()
    return outs


def test_greedy_matches_generate_and_offsets_are_contiguous(tiny: LoadedModel) -> None:
    prompts = ["Hello", "The capital of France", "tokenwire streams tokens over"]
    reqs = [
        GenerationRequest(
            f"r{i}", [{"role": "user", "content": p}], SamplingParams(max_tokens=12, temperature=0)
        )
        for i, p in enumerate(prompts)
    ]
    outs = run_all(SimpleEngine(tiny), reqs)
    for r in reqs:
        steps = outs[r.key]
        ids = [t for o in steps for t in o.token_ids] or None
        pos = 0
        for o in steps:
            assert o.offset == pos
            pos += o.n
        prompt = torch.tensor([tiny.encode_chat(r.messages)])
        ref = tiny.model.generate(prompt, max_new_tokens=12, do_sample=False)[0, prompt.shape[1] :].tolist()
        eos = next((i for i, t in enumerate(ref) if t in tiny.eos_ids), None)
        ref = ref if eos is None else ref[: eos + 1]
        assert pos == len(ref)
        text = "".join(o.text for o in steps)
        assert text == tiny.decode(ref)
        assert ids is None or ids == ref


def test_a_request_resumed_at_its_end_ends_with_no_more_tokens(tiny: LoadedModel) -> None:
    """A worker that died between a request's last token and its end leaves a log that a resume finds
    full: it ends "length" at once, no token past max_tokens (nor past the context window), with the
    limit it had reached (done.length_reason)."""
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    full = run_all(SimpleEngine(tiny), [GenerationRequest("r", [{"role": "user", "content": "Hello"}], p)])
    ids = [t for o in full["r"] for t in o.token_ids]
    assert len(ids) == 6 and full["r"][-1].length_reason == "max_tokens"
    again = run_all(
        SimpleEngine(tiny),
        [GenerationRequest("r", [{"role": "user", "content": "Hello"}], p, resume_ids=ids)],
    )
    assert [(o.offset, o.n, o.finish, o.length_reason) for o in again["r"]] == [
        (6, 0, "length", "max_tokens")
    ]
    engine = SimpleEngine(tiny)
    hi = [{"role": "user", "content": "Hi"}]
    prompt = engine.prepare(GenerationRequest("w", hi)).prompt_ids
    assert prompt is not None
    room = engine.max_context - len(prompt)  # logged tokens that fill the window to its last position
    window = SamplingParams(max_tokens=room + 10, temperature=0, ignore_eos=True)
    again = run_all(engine, [GenerationRequest("w", hi, window, resume_ids=[5] * room)])
    assert [(o.n, o.finish, o.length_reason) for o in again["w"]] == [(0, "length", "context")]


def test_same_seed_same_text_and_max_tokens(tiny: LoadedModel) -> None:
    p = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)
    reqs = [GenerationRequest(k, [{"role": "user", "content": "Hello"}], p) for k in ("a", "b")]
    reqs.append(
        GenerationRequest(
            "c",
            [{"role": "user", "content": "Hello"}],
            SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95, seed=8, ignore_eos=True),
        )
    )
    outs = run_all(SimpleEngine(tiny), reqs)
    texts = {k: "".join(o.text for o in v) for k, v in outs.items()}
    assert texts["a"] == texts["b"]
    assert outs["a"][-1].finish == "length" and sum(o.n for o in outs["a"]) == 10
    assert texts["a"] != texts["c"] or texts["a"] == ""  # another seed draws another text


def test_prompt_over_budget_is_too_large(tiny: LoadedModel) -> None:
    engine = SimpleEngine(tiny, max_prompt_tokens=8)
    outs = run_all(engine, [GenerationRequest("big", [{"role": "user", "content": "Hello " * 50}])])
    [o] = outs["big"]
    assert (o.finish, o.error_code, o.n) == ("error", "too_large", 0)
