"""BatchingEngine on its thread, on a tiny random Llama: the Engine protocol the worker relies on."""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import pytest
import torch

from server.engine.api import EngineOverloaded, GenerationRequest, SamplingParams, StepOutput
from server.engine.engine import BatchingEngine, default_pools
from server.engine.model import LoadedModel, load_model

POOLS = ((6, 64), (2, 256))


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> LoadedModel:
    return load_model(tiny_model_dir)


def engine(m: LoadedModel, **kw: object) -> BatchingEngine:
    kw.setdefault("pools", POOLS)
    kw.setdefault("prefill_tokens", 32)
    return BatchingEngine(m, **kw)  # type: ignore[arg-type]


class Collector:
    def __init__(self) -> None:
        self.calls: queue.Queue[list[StepOutput]] = queue.Queue()
        self.all: list[list[StepOutput]] = []

    def __call__(self, outs: list[StepOutput]) -> None:
        assert threading.current_thread().name == "engine"
        self.calls.put(outs)

    def until_done(self, keys: set[str]) -> dict[str, list[StepOutput]]:
        got: dict[str, list[StepOutput]] = {k: [] for k in keys}
        pending = set(keys)
        while pending:
            outs = self.calls.get(timeout=60)
            self.all.append(outs)
            for o in outs:
                got.setdefault(o.key, []).append(o)
                if o.finish:
                    pending.discard(o.key)
        return got


def run_all(
    e: BatchingEngine, reqs: list[GenerationRequest]
) -> tuple[dict[str, list[StepOutput]], Collector]:
    c = Collector()
    e.start(c)
    try:
        for r in reqs:
            e.submit(r)
        return c.until_done({r.key for r in reqs}), c
    finally:
        e.stop()


def msg(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def reference(m: LoadedModel, messages: list[dict[str, str]], n: int) -> list[int]:
    prompt = torch.tensor([m.encode_chat(messages)])
    ref: list[int] = m.model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False
    )[0, prompt.shape[1] :].tolist()
    eos = next((i for i, t in enumerate(ref) if t in m.eos_ids), None)
    return ref if eos is None else ref[: eos + 1]


def test_greedy_matches_generate_with_contiguous_offsets(tiny: LoadedModel) -> None:
    prompts = ["Hello", "The capital of France", "tokenwire streams tokens over", "naïve café 東京 🚀"]
    reqs = [
        GenerationRequest(f"r{i}", msg(p), SamplingParams(max_tokens=16, temperature=0))
        for i, p in enumerate(prompts)
    ]
    e = engine(tiny)
    outs, _ = run_all(e, reqs)
    assert e.requests_started == 4
    for r in reqs:
        steps = outs[r.key]
        pos = 0
        for o in steps:
            assert o.offset == pos and len(o.token_ids) == o.n
            assert o.prompt_tokens == len(tiny.encode_chat(r.messages))
            pos += o.n
        ids = [t for o in steps for t in o.token_ids]
        assert ids == reference(tiny, r.messages, 16)
        assert "".join(o.text for o in steps) == tiny.decode(ids)
        assert steps[-1].finish in ("stop", "length")


def test_one_callback_per_step_carries_every_sequence(tiny: LoadedModel) -> None:
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    reqs = [GenerationRequest(f"r{i}", msg(f"Hello {i}"), p) for i in range(4)]
    e = engine(tiny)
    _, c = run_all(e, reqs)
    assert any(len({o.key for o in outs}) == 4 for outs in c.all)  # all four in one hand-off
    for outs in c.all:
        keys = [o.key for o in outs]
        assert len(keys) == len(set(keys))  # never two outputs of one request in one hand-off
    assert len(c.all) <= e.steps
    assert e.tokens_generated == 4 * 12


def test_cancel_stops_a_request_at_the_next_step(tiny: LoadedModel) -> None:
    e = engine(tiny)
    c = Collector()
    e.start(c)
    try:
        long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        e.submit(GenerationRequest("a", msg("Hello"), long))
        e.submit(GenerationRequest("b", msg("Hello there"), SamplingParams(max_tokens=40, temperature=0)))
        seen_a = 0
        while seen_a < 3:
            seen_a += sum(o.n for o in c.calls.get(timeout=60) if o.key == "a")
        e.cancel("a")
        outs = c.until_done({"b"})
    finally:
        e.stop()
    assert all(o.finish is None for o in outs["a"])  # cancelled requests produce no finish
    assert seen_a + sum(o.n for o in outs["a"]) < 200
    assert e.requests_started == 2


def test_prompt_over_budget_is_too_large(tiny: LoadedModel) -> None:
    e = engine(tiny, pools=((2, 16),))
    outs, _ = run_all(e, [GenerationRequest("big", msg("Hello " * 50))])
    [o] = outs["big"]
    assert (o.finish, o.error_code, o.n) == ("error", "too_large", 0)
    assert e.requests_started == 0


def test_a_request_that_cannot_be_read_fails_alone(tiny: LoadedModel) -> None:
    ok = GenerationRequest("ok", msg("Hello"), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    outs, _ = run_all(engine(tiny), [GenerationRequest("bad", prompt_ids=[10**9]), ok])
    [bad] = outs["bad"]
    assert (bad.finish, bad.error_code) == ("error", "internal")
    assert outs["ok"][-1].finish == "length"


def test_a_length_says_whether_max_tokens_or_the_context_window_ended_it(tiny: LoadedModel) -> None:
    """StepOutput.length_reason (done.length_reason, SPEC 12), from the engine that knows which limit it
    hit: the context window (the largest slot, 64 here) as a reply fills it, and also when a request is
    resumed with its window already full; max_tokens otherwise."""
    p = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    asked = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    e = engine(tiny, pools=((4, 64),))
    outs, _ = run_all(
        e, [GenerationRequest("window", msg("Hello"), p), GenerationRequest("asked", msg("Hi"), asked)]
    )
    end = outs["window"][-1]
    assert (end.finish, end.length_reason) == ("length", "context")
    assert end.prompt_tokens + sum(o.n for o in outs["window"]) == 64
    assert (outs["asked"][-1].finish, outs["asked"][-1].length_reason) == ("length", "max_tokens")
    ids = [t for o in outs["window"] for t in o.token_ids]
    again, _ = run_all(
        engine(tiny, pools=((4, 64),)), [GenerationRequest("window", msg("Hello"), p, resume_ids=ids)]
    )
    [o] = again["window"]
    assert (o.finish, o.length_reason, o.offset, o.n) == ("length", "context", len(ids), 0)


def test_full_waiting_queue_refuses_with_retry_after(tiny: LoadedModel) -> None:
    e = engine(tiny, max_waiting=2)  # not started: nothing leaves the queue
    e.submit(GenerationRequest("a", msg("Hello")))
    e.submit(GenerationRequest("b", msg("Hello")))
    with pytest.raises(EngineOverloaded) as exc:
        e.submit(GenerationRequest("c", msg("Hello")))
    assert exc.value.retry_after_ms > 0


def test_resume_continues_after_the_logged_tokens(tiny: LoadedModel) -> None:
    p = SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True)
    full, _ = run_all(engine(tiny), [GenerationRequest("r", msg("Hello"), p)])
    ids = [t for o in full["r"] for t in o.token_ids]
    resumed, _ = run_all(engine(tiny), [GenerationRequest("r", msg("Hello"), p, resume_ids=ids[:8])])
    assert resumed["r"][0].offset == 8
    assert [t for o in resumed["r"] for t in o.token_ids] == ids[8:]
    assert resumed["r"][-1].finish == "length"


def test_session_turns_reuse_the_cache(tiny: LoadedModel) -> None:
    e = engine(tiny)
    c = Collector()
    e.start(c)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    try:
        history = msg("The capital of France")
        e.submit(GenerationRequest("t1", history, greedy, session="S"))
        reply = "".join(o.text for o in c.until_done({"t1"})["t1"])
        history = [*history, {"role": "assistant", "content": reply}, *msg("And Japan?")]
        e.submit(GenerationRequest("t2", history, greedy, session="S"))
        second = [t for o in c.until_done({"t2"})["t2"] for t in o.token_ids]
    finally:
        e.stop()
    assert e.sched.reused_tokens > 10
    assert second == reference(tiny, history, 12)[:12]


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    e = engine(tiny)
    real = e.runner.step
    calls = {"n": 0}

    def flaky(batch: object) -> list[int]:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real(batch)  # type: ignore[arg-type]

    monkeypatch.setattr(e.runner, "step", flaky)
    c = Collector()
    e.start(c)
    try:
        e.submit(GenerationRequest("a", msg("Hello"), SamplingParams(max_tokens=10, temperature=0)))
        [o] = c.until_done({"a"})["a"][-1:]
        assert (o.finish, o.error_code) == ("error", "internal")
        e.submit(
            GenerationRequest("b", msg("Hello"), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
        )
        assert c.until_done({"b"})["b"][-1].finish == "length"
    finally:
        e.stop()


def test_default_pools_split_the_budget() -> None:
    per_token = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M in fp32
    pools = default_pools(per_token, 2048, 48, 1536 << 20)
    (n_short, short), (n_long, long) = pools
    assert (short, long) == (512, 2048) and n_short >= 48 and n_long >= 1
    assert (n_short * short + n_long * long) * per_token <= 1536 << 20
    assert default_pools(256, 256, 4, 1 << 30) == ((8, 256),)  # small context: one pool


def test_kv_usage_reports_the_slots_held_each_step(tiny: LoadedModel) -> None:
    """The tokenwire_kv_cache_usage_ratio gauge reads kv_usage(): it rises while sequences hold slots,
    keeps a session's cached prefix, and falls to 0 when nothing is held."""
    e = engine(tiny)
    seen: list[tuple[int, float]] = []  # (outputs in this step, usage after it), on the engine thread

    def on_step(outs: list[StepOutput]) -> None:
        seen.append((len(outs), e.kv_usage()))
        c(outs)

    c = Collector()
    e.start(on_step)
    try:
        assert e.kv_usage() == 0.0
        p = SamplingParams(max_tokens=12, temperature=0)
        e.submit(GenerationRequest("u1", msg("Hello"), p))
        e.submit(GenerationRequest("u2", msg("Hello there"), p, session="s1"))
        c.until_done({"u1", "u2"})
    finally:
        e.stop()
    running = [u for n, u in seen[:-1]]
    assert running and all(0.0 < u <= 1.0 for u in running)
    # After the last step: u1's slot is free; s1's prefix is kept for its next turn (prefix reuse).
    total = sum(n * length for n, length in POOLS)
    held = e.sched.table.usage() * total
    assert seen[-1][1] == e.sched.table.usage() and 0 < held < total
    e.sched.table.drop_prefix(e.sched.table.prefixes["s1"])
    assert e.sched.table.usage() == 0.0


def test_prompt_tokens_reused_are_counted_by_source_and_scraped(tiny: LoadedModel) -> None:
    """tokenwire_prompt_tokens_reused_total{source}: a session's next turn counts under "session", a
    prompt that starts like a running one's (the same user) under "shared"; the worker's collector reads
    the engine's counts when scraped. Each request's outputs carry its own count as ``cached_tokens``
    (the usage a client is shown)."""
    from server import metrics

    e = engine(tiny)
    c = Collector()
    e.start(c)
    text = "The quick brown fox jumps over the lazy dog, then naps under the old oak tree."
    p = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    try:
        assert e.prompt_tokens_reused() == {"session": 0, "shared": 0}
        e.submit(GenerationRequest("a", msg(text), p, session="s1", user="u"))
        while not any(o.key == "a" for o in c.calls.get(timeout=60)):
            pass  # a's first token: its prompt is in its slot
        e.submit(GenerationRequest("b", msg(text + " Why?"), p, user="u"))
        first = c.until_done({"a", "b"})
        shared = e.prompt_tokens_reused()["shared"]
        a, b = e.m.encode_chat(msg(text)), e.m.encode_chat(msg(text + " Why?"))
        assert shared == next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y) > 8
        first_turn = [*msg(text), {"role": "assistant", "content": "ok"}]
        e.submit(GenerationRequest("a2", [*first_turn, *msg("More?")], p, session="s1", user="u"))
        second = c.until_done({"a2"})
        counts = e.prompt_tokens_reused()
    finally:
        e.stop()
    assert counts["shared"] == shared and counts["session"] > 0
    assert {o.cached_tokens for o in first["a"]} == {0}
    assert {o.cached_tokens for o in first["b"]} == {shared}
    assert {o.cached_tokens for o in second["a2"]} == {counts["session"]}
    assert all(o.cached_tokens < o.prompt_tokens for o in second["a2"])
    metrics.PROMPT_REUSE.read = e.prompt_tokens_reused
    try:
        text_out = metrics.render()[0].decode()
    finally:
        metrics.PROMPT_REUSE.read = None
    assert f'tokenwire_prompt_tokens_reused_total{{source="shared"}} {float(shared)}' in text_out
    assert f'tokenwire_prompt_tokens_reused_total{{source="session"}} {float(counts["session"])}' in text_out
