"""The scheduler with a fake runner: no model, no torch.

The fake runner keeps, for every slot, the token id fed at each position (a stand-in for its K/V), applies
the scheduler's moves and swaps to those lists, and checks before every forward that a sequence's slot
holds exactly that sequence's earlier tokens. Its "model" picks the next token from the whole token
prefix, so a request's output is the same however it was batched, chunked, moved or preempted — and any
KV mix-up changes it.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.engine.api import POOLED_OWNERS, SamplingParams, StepOutput
from server.engine.kv_cache import Move, SlotTable, Swap
from server.engine.scheduler import Batch, QueueFull, Scheduler, SchedulerConfig

VOCAB = 50
EOS = 0


def fake_decode(ids: Sequence[int]) -> str:
    return "".join(chr(ord("a") + (t % 26)) for t in ids)


def next_token(prefix: Sequence[int]) -> int:
    """The fake model: a deterministic function of the whole prefix, never EOS."""
    h = 7
    for t in prefix:
        h = (h * 31 + t) % 1_000_003
    return 1 + h % (VOCAB - 1)


class FakeRunner:
    def __init__(self, pools: Sequence[tuple[int, int]]) -> None:
        self.kv = {(p, s): [-1] * length for p, (n, length) in enumerate(pools) for s in range(n)}
        self.fed = 0  # tokens fed in total (prefill plus decode)
        self.steps: list[Batch] = []

    def step(self, batch: Batch) -> list[int]:
        for op in batch.ops:
            if isinstance(op, Move):
                self.kv[op.dst][: op.length] = self.kv[op.src][: op.length]
            elif isinstance(op, Swap):
                a, b = self.kv[op.a], self.kv[op.b]
                a[: op.length], b[: op.length] = b[: op.length], a[: op.length]
        out = []
        seen = set()
        for w in batch.work:
            assert w.seq.slot is not None
            assert w.seq.slot not in seen, "two sequences in one slot"
            seen.add(w.seq.slot)
            kv = self.kv[w.seq.slot]
            assert w.start + w.n <= len(kv), "fed past the end of the slot: KV budget exceeded"
            assert kv[: w.start] == w.seq.tokens[: w.start], f"{w.seq.key}: slot holds other tokens"
            kv[w.start : w.start + w.n] = w.ids
            self.fed += w.n
            if w.sample:
                out.append(next_token(w.seq.tokens[: w.start + w.n]))
        self.steps.append(batch)
        return out


def make(
    pools: Sequence[tuple[int, int]] = ((8, 64),),
    *,
    max_running: int = 8,
    prefill_tokens: int = 32,
    prefill_tokens_decoding: int | None = None,
    max_waiting: int = 64,
    reuse: bool = True,
    clock: list[float] | None = None,
    share: int = 0,
    public: Sequence[int] = (),
    tenant: bool = False,
) -> tuple[Scheduler, FakeRunner]:
    cfg = SchedulerConfig(
        pools=tuple(pools),
        max_running=max_running,
        prefill_tokens=prefill_tokens,
        prefill_tokens_decoding=prefill_tokens_decoding,
        max_waiting=max_waiting,
        eos_ids=frozenset({EOS}),
        prefix_reuse=reuse,
        share_min_tokens=share,
        public_prefix=tuple(public),
        share_across_users=tenant,
    )
    now = clock if clock is not None else [0.0]
    return Scheduler(cfg, fake_decode, clock=lambda: now[0]), FakeRunner(pools)


def step(s: Scheduler, r: FakeRunner) -> list[StepOutput]:
    batch = s.schedule()
    outs = s.postprocess(batch, r.step(batch))
    s.table.check()
    for seq in s.running:
        assert seq.slot is not None and seq.kv_len <= s.table.slot_len(seq.slot[0])
    return outs


def run(s: Scheduler, r: FakeRunner, limit: int = 10_000) -> dict[str, list[StepOutput]]:
    outs: dict[str, list[StepOutput]] = {}
    for _ in range(limit):
        if not s.has_work():
            return outs
        for o in step(s, r):
            outs.setdefault(o.key, []).append(o)
    raise AssertionError("scheduler did not finish")


def reference(prompt: Sequence[int], max_tokens: int) -> list[int]:
    toks = list(prompt)
    for _ in range(max_tokens):
        toks.append(next_token(toks))
    return toks[len(prompt) :]


def prompt(n: int, salt: int = 0) -> list[int]:
    return [1 + (i * 7 + salt * 13) % (VOCAB - 1) for i in range(n)]


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)  # type: ignore[arg-type]


def check_stream(outs: list[StepOutput], expected: list[int], start: int = 0) -> None:
    pos = start
    for o in outs:
        assert o.offset == pos
        assert len(o.token_ids) == o.n
        pos += o.n
    assert [t for o in outs for t in o.token_ids] == expected
    assert "".join(o.text for o in outs) == fake_decode(expected)
    assert outs[-1].finish is not None and all(o.finish is None for o in outs[:-1])


# ---- the module itself ---------------------------------------------------------------------------


def test_scheduler_never_imports_torch() -> None:
    code = (
        "import sys; import server.engine.scheduler, server.engine.kv_cache; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'transformers'))]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---- admission, budgets, fairness ----------------------------------------------------------------


def test_admission_respects_max_running_and_waiting_ones_join_as_others_finish() -> None:
    s, r = make(((8, 64),), max_running=2)
    lens = {"a": 3, "b": 9, "c": 4, "d": 2}
    for i, (k, n) in enumerate(lens.items()):
        s.add(k, prompt(5, i), greedy(n))
    admitted_at: dict[str, int] = {}
    finished_at: dict[str, int] = {}
    outs: dict[str, list[StepOutput]] = {}
    for i in range(40):
        if not s.has_work():
            break
        assert len(s.running) <= 2
        for o in step(s, r):
            outs.setdefault(o.key, []).append(o)
            if o.finish:
                finished_at[o.key] = i
        for seq in s.running:
            admitted_at.setdefault(seq.key, i)
    assert sorted(admitted_at, key=admitted_at.__getitem__) == ["a", "b", "c", "d"]  # FIFO
    # c joins the step after a leaves, while b is still decoding: iteration-level batching.
    assert admitted_at["c"] == finished_at["a"] + 1 < finished_at["b"]
    for i, (k, n) in enumerate(lens.items()):
        check_stream(outs[k], reference(prompt(5, i), n))


def test_chunked_prefill_stays_within_budget_and_never_stalls_decoding() -> None:
    s, r = make(((4, 512),), prefill_tokens=16)
    s.add("short", prompt(4), greedy(30))
    step(s, r)  # short is prefilled and decoding
    s.add("long", prompt(100, 1), greedy(5))
    chunks = []
    first: list[StepOutput] = []
    while any(q.key == "long" for q in s.waiting) or s.by_key["long"].kv_len < 100:
        batch = s.schedule()
        decode = [w for w in batch.work if w.seq.key == "short"]
        assert len(decode) == 1 and decode[0].n == 1  # short gets its token every step
        prefill = sum(w.n for w in batch.work if w.seq.key == "long")
        assert prefill <= 16
        chunks.append(prefill)
        first += [o for o in s.postprocess(batch, r.step(batch)) if o.key == "long"]
    assert chunks == [16] * 6 + [4]
    outs = run(s, r)
    check_stream(first + outs["long"], reference(prompt(100, 1), 5))


def test_a_smaller_prefill_budget_applies_only_while_someone_decodes() -> None:
    s, r = make(((4, 512),), prefill_tokens=40, prefill_tokens_decoding=10)
    s.add("long", prompt(100), greedy(20))
    first = s.schedule()  # nobody decodes yet: the idle budget
    assert [(w.seq.key, w.n) for w in first.work] == [("long", 40)]
    s.postprocess(first, r.step(first))
    while s.by_key["long"].kv_len < 100:
        step(s, r)
    assert s.by_key["long"].kv_len == 100  # 40 + 40 + 20: still alone, so still the idle budget
    assert len(r.steps) == 3
    s.add("next", prompt(50, 1), greedy(3))
    chunks = []
    got: list[StepOutput] = []
    while s.by_key["next"].kv_len < 50:
        batch = s.schedule()
        assert [w.n for w in batch.work if w.seq.key == "long"] == [1]  # long decodes every step
        chunks.append(sum(w.n for w in batch.work if w.seq.key == "next"))
        got += [o for o in s.postprocess(batch, r.step(batch)) if o.key == "next"]
    assert chunks == [10] * 5  # the decoding budget while long streams
    outs = run(s, r)
    check_stream(got + outs["next"], reference(prompt(50, 1), 3))
    check_stream(outs["long"], reference(prompt(100), 20)[6:], start=6)  # 1 at prefill + 5 above


def test_a_request_arriving_while_31_decode_gets_its_first_token_in_the_next_step() -> None:
    s, r = make(((40, 256),), max_running=32, prefill_tokens=256)
    for i in range(31):
        s.add(f"r{i}", prompt(20, i), greedy(100))
    while any(q.kv_len < 20 for q in [*s.running, *s.waiting]):
        step(s, r)
    s.add("late", prompt(120, 99), greedy(5))
    batch = s.schedule()
    assert sum(1 for w in batch.work if w.n == 1) == 31  # nobody's next token waits for the prefill
    [late] = [w for w in batch.work if w.seq.key == "late"]
    assert (late.n, late.sample) == (120, True)  # the whole prompt, and its first token, in this step
    outs = s.postprocess(batch, r.step(batch))
    assert [o.token_ids for o in outs if o.key == "late"] == [(reference(prompt(120, 99), 1)[0],)]


def test_kv_budget_never_exceeded_and_long_sequences_move_to_the_long_pool() -> None:
    pools = ((4, 16), (1, 64))
    s, r = make(pools, prefill_tokens=64)
    s.add("grows", prompt(10), greedy(30))
    s.add("small", prompt(3, 1), greedy(4))
    outs = run(s, r)  # step() checks kv_len <= slot length and the slot table after every step
    moves = [op for b in r.steps for op in b.ops if isinstance(op, Move) and op.src[0] != op.dst[0]]
    assert moves and moves[0].src[0] == 0 and moves[0].dst[0] == 1  # promoted with its KV
    check_stream(outs["grows"], reference(prompt(10), 30))
    check_stream(outs["small"], reference(prompt(3, 1), 4))


def test_preemption_recomputes_and_continues_the_same_stream() -> None:
    # One long slot for two sequences that both outgrow the short pool: the newer one is preempted.
    pools = ((4, 16), (1, 64))
    s, r = make(pools, prefill_tokens=64)
    s.add("old", prompt(12), greedy(20))
    s.add("new", prompt(12, 1), greedy(20))
    outs = run(s, r)
    assert s.preemptions >= 1
    assert s.by_key == {}
    check_stream(outs["old"], reference(prompt(12), 20))
    check_stream(outs["new"], reference(prompt(12, 1), 20))  # no gap, no repeat, same tokens
    # Recompute fed the preempted tokens again: more tokens fed than prompts plus completions.
    assert r.fed > 2 * (12 + 20)


def test_preempted_sequence_goes_back_ahead_of_newer_requests() -> None:
    pools = ((4, 16), (1, 64))
    s, r = make(pools, prefill_tokens=64, max_running=4)
    s.add("old", prompt(12), greedy(20))
    s.add("new", prompt(12, 1), greedy(20))
    while s.preemptions == 0:
        step(s, r)
    s.add("later", prompt(3, 2), greedy(2))
    assert [q.key for q in s.waiting][:1] == ["new"]
    assert [q.key for q in s.waiting][-1] == "later"


def test_cancel_takes_effect_at_the_next_step() -> None:
    s, r = make(((2, 64),), max_running=2)
    s.add("a", prompt(4), greedy(50))
    s.add("b", prompt(4, 1), greedy(50))
    s.add("c", prompt(4, 2), greedy(3))
    step(s, r)
    step(s, r)
    assert s.cancel("a") is not None
    assert s.cancel("c") is not None  # still waiting
    assert s.cancel("nope") is None
    batch = s.schedule()
    assert {w.seq.key for w in batch.work} == {"b"}
    s.postprocess(batch, r.step(batch))
    s.table.check()
    assert s.table.running_in(0) == 1


def test_fifo_fairness_under_a_steady_stream() -> None:
    s, r = make(((3, 64),), max_running=3, prefill_tokens=8)
    order: list[str] = []
    for i in range(30):
        s.add(f"r{i}", prompt(6, i), greedy(1 + (i * 5) % 7))
        for seq in s.running:
            if seq.key not in order:
                order.append(seq.key)
        step(s, r)
    run(s, r)
    assert order == sorted(order, key=lambda k: int(k[1:]))


def test_waiting_queue_is_bounded_with_a_retry_estimate() -> None:
    clock = [0.0]
    s, r = make(((1, 64),), max_running=1, max_waiting=3, clock=clock)
    s.add("r0", prompt(4), greedy(3))
    s.add("r1", prompt(4, 1), greedy(50))
    while "r1" not in {q.key for q in s.running}:
        clock[0] += 0.5
        step(s, r)
    for i in range(2, 5):
        s.add(f"r{i}", prompt(4, i), greedy(2))
    with pytest.raises(QueueFull) as exc:
        s.add("late", prompt(4), greedy(2))
    # r0 admitted at 0.5 s and done after 3 steps, r1 admitted at 2 s: one admission every 1.5 s.
    assert exc.value.retry_after_ms == 1500
    preempted_are_not_new = s.new_waiting()
    assert preempted_are_not_new == 3
    run(s, r)
    s.add("late", prompt(4), greedy(2))  # room again


# ---- output rules: EOS, stop strings, max_tokens, resume ------------------------------------------


def test_eos_counts_as_a_token_with_no_text() -> None:
    s, r = make()
    s.add("e", prompt(4), greedy(10))
    step(s, r)  # prefill samples the first token
    batch = s.schedule()
    assert len(batch.work) == 1
    outs = s.postprocess(batch, [EOS])
    [o] = outs
    assert o.finish == "stop" and o.token_ids[-1] == EOS
    assert o.offset + o.n == 2  # first token plus EOS
    assert s.table.running_in(0) == 0


def test_stop_string_ends_the_text_before_it() -> None:
    expected = reference(prompt(4), 12)
    text = fake_decode(expected)
    stop = text[5:7]
    s, r = make()
    s.add("s", prompt(4), greedy(12, stop=(stop,)))
    outs = run(s, r)["s"]
    assert outs[-1].finish == "stop"
    assert "".join(o.text for o in outs) == text[: text.index(stop)]


def test_max_tokens_counts_resumed_tokens() -> None:
    full = reference(prompt(4), 10)
    s, r = make()
    s.add("r", prompt(4), greedy(10), resume_ids=full[:6])
    outs = run(s, r)["r"]
    assert outs[0].offset == 6
    check_stream(outs, full[6:], start=6)
    assert outs[-1].finish == "length"
    assert outs[-1].length_reason == "max_tokens"


def test_a_length_says_which_limit_ended_it() -> None:
    """done.length_reason (SPEC 12): max_tokens, or the context window (the largest slot) full; when both
    come with the same token it is the window, since asking for more tokens would not give any."""
    s, r = make(((4, 64),))
    s.add("window", prompt(60), greedy(100))
    s.add("asked", prompt(8), greedy(5))
    s.add("both", prompt(54), greedy(10))  # 54 + 10 = 64: the tenth token fills the slot
    s.add("stopped", prompt(4), greedy(10, stop=(fake_decode(reference(prompt(4), 10))[2:4],)))
    outs = run(s, r)
    assert [(o.finish, o.length_reason) for o in outs["window"]][-1] == ("length", "context")
    assert sum(o.n for o in outs["window"]) == 4  # 60 + 4 = the slot's 64
    assert (outs["asked"][-1].finish, outs["asked"][-1].length_reason) == ("length", "max_tokens")
    assert (outs["both"][-1].finish, outs["both"][-1].length_reason) == ("length", "context")
    assert (outs["stopped"][-1].finish, outs["stopped"][-1].length_reason) == ("stop", "")
    assert all(o.length_reason == "" for k in outs for o in outs[k][:-1])


# ---- session prefix reuse ------------------------------------------------------------------------


def test_session_turn_reuses_the_previous_turns_kv() -> None:
    s, r = make(((4, 128),), prefill_tokens=256)
    p1 = prompt(20)
    s.add("t1", p1, greedy(8), session="S")
    out1 = run(s, r)["t1"]
    reply = [t for o in out1 for t in o.token_ids]
    p2 = p1 + reply + prompt(6, 3)
    fed_before = r.fed
    seq = s.add("t2", p2, greedy(8), session="S")
    out2 = run(s, r)["t2"]
    check_stream(out2, reference(p2, 8))
    # Turn 1 left prompt + completion (less the unfed last token) in its slot: turn 2 feeds the rest.
    assert seq.reused == len(p1) + len(reply) - 1
    assert r.fed - fed_before == len(p2) - seq.reused + 7


def test_reuse_off_feeds_the_whole_prompt_with_the_same_output() -> None:
    outs = {}
    for reuse in (True, False):
        s, r = make(((4, 128),), reuse=reuse)
        s.add("t1", prompt(20), greedy(8), session="S")
        reply = [t for o in run(s, r)["t1"] for t in o.token_ids]
        s.add("t2", prompt(20) + reply + prompt(5, 2), greedy(8), session="S")
        outs[reuse] = [t for o in run(s, r)["t2"] for t in o.token_ids]
    assert outs[True] == outs[False]


def test_cached_prefixes_are_evicted_lru_when_slots_are_needed() -> None:
    s, r = make(((2, 64),), max_running=2)
    for i in range(3):
        s.add(f"s{i}", prompt(5, i), greedy(3), session=f"S{i}")
        run(s, r)
    assert list(s.table.prefixes) == ["S1", "S2"]  # S0 was least recently used
    s.add("x", prompt(5, 9), greedy(3))
    s.add("y", prompt(5, 8), greedy(30))
    step(s, r)
    assert s.table.prefixes == {}  # two running sequences need both slots


HEAD = prompt(20, 5)  # the leading tokens the prompts below have in common


def step_into(outs: dict[str, list[StepOutput]], s: Scheduler, r: FakeRunner) -> None:
    for o in step(s, r):
        outs.setdefault(o.key, []).append(o)


def run_into(outs: dict[str, list[StepOutput]], s: Scheduler, r: FakeRunner) -> dict[str, list[StepOutput]]:
    for key, more in run(s, r).items():
        outs.setdefault(key, []).extend(more)
    return outs


def test_a_new_request_copies_the_kv_of_the_prompt_start_a_running_one_holds() -> None:
    s, r = make(((4, 128),), prefill_tokens=256, share=8)
    a = HEAD + prompt(10, 1)
    s.add("a", a, greedy(30), user="u")
    step(s, r)  # a's prompt is in its slot now
    b = HEAD + prompt(7, 2)
    s.add("b", b, greedy(8), user="u")
    fed_before = r.fed
    batch = s.schedule()
    [work] = [w for w in batch.work if w.seq.key == "b"]
    assert (work.start, work.n) == (len(HEAD), len(b) - len(HEAD))
    assert Move(s.by_key["a"].slot, s.by_key["b"].slot, len(HEAD)) in batch.ops  # type: ignore[arg-type]
    outs: dict[str, list[StepOutput]] = {}
    for o in s.postprocess(batch, r.step(batch)):  # the fake runner checks b's slot holds HEAD first
        outs.setdefault(o.key, []).append(o)
    run_into(outs, s, r)
    check_stream(outs["b"], reference(b, 8))
    assert s.shared_tokens == len(HEAD)
    assert {o.cached_tokens for o in outs["b"]} == {len(HEAD)}  # its usage: HEAD was not computed for it
    assert {o.cached_tokens for o in outs["a"]} == {0}
    # b fed its prompt less HEAD, then 7 tokens; a its 29 tokens after the first
    assert r.fed - fed_before == len(b) - len(HEAD) + 7 + 29


def test_cached_tokens_report_the_first_admission_not_a_readmission() -> None:
    """A preempted sequence computed its whole prompt when first admitted: what it copies on readmission
    (here a finished session turn's prompt start, kept by then) changes its timing, not the usage its
    client is shown."""
    pools = ((4, 16), (1, 64))
    s, r = make(pools, prefill_tokens=64, share=8)
    s.add("old", HEAD[:10] + prompt(2, 1), greedy(20), user="u")
    s.add("new", HEAD[:10] + prompt(2, 2), greedy(20), user="u")  # same step: old's KV not there yet
    outs: dict[str, list[StepOutput]] = {}
    step_into(outs, s, r)
    s.add("kept", HEAD[:10] + prompt(1, 3), greedy(2), user="u", session="S")
    while s.preemptions == 0 or "S" not in s.table.prefixes:
        step_into(outs, s, r)
    while s.by_key["new"].slot is None:
        step_into(outs, s, r)
    assert s.by_key["new"].reused >= 10  # readmitted with old's prompt start copied
    run_into(outs, s, r)
    check_stream(outs["new"], reference(HEAD[:10] + prompt(2, 2), 20))
    assert {o.cached_tokens for o in outs["new"]} == {0}
    assert {o.prompt_tokens for o in outs["new"]} == {12}


def test_a_finished_turn_without_a_session_is_kept_for_its_callers_next_turn() -> None:
    """The HTTP doors send the whole conversation every turn and have no session: a finished turn is
    kept all the same, and the same caller's next turn (its prompt starts with the whole previous turn)
    copies it. A pooled owner's turn is not kept (nobody could copy more than the public prefix), nor
    any with sharing off; a stranger copies only the public prefix from it."""
    first = HEAD + prompt(6, 1)
    for user, share, kept in (("u", 8, True), (sorted(POOLED_OWNERS)[0], 8, False), ("u", 0, False)):
        s, r = make(((4, 128),), prefill_tokens=256, share=share, public=HEAD[:4])
        s.add("t1", first, greedy(10), user=user)
        outs = run(s, r)
        assert bool(s.table.prefixes) == kept, (user, share)
        reply = [t for o in outs["t1"] for t in o.token_ids]
        second = [*first, *reply, *prompt(5, 2)]
        s.add("t2", second, greedy(6), user=user)
        s.add("other", [*first, *prompt(3, 3)], greedy(6), user="stranger")
        step_into(outs, s, r)
        # The last token of t1's reply was sampled, never fed: the kept KV ends one before it.
        expected = len(first) + len(reply) - 1 if kept else 0
        assert s.by_key["t2"].reused == expected, (user, share)
        assert s.by_key["other"].reused == 0  # HEAD[:4] is below the 8-token minimum
        run_into(outs, s, r)
        check_stream(outs["t2"], reference(second, 6))
        assert {o.cached_tokens for o in outs["t2"]} == {expected}


def test_a_callers_next_turn_takes_its_kept_turn_over_even_when_slots_are_short() -> None:
    """Two slots, both holding finished turns: u's and then a stranger's. u's next turn takes its own kept
    turn's slot over (nothing evicted, nothing copied), and the stranger's stays. Over four turns one
    kept turn is left, not one per turn."""
    s, r = make(((2, 128),), prefill_tokens=256, share=8)
    t1 = HEAD + prompt(6, 1)
    s.add("t1", t1, greedy(5), user="u")
    outs = run(s, r)
    s.add("v1", prompt(30, 7), greedy(5), user="v")
    run_into(outs, s, r)
    assert len(s.table.prefixes) == 2  # no free slot left
    history = [*t1, *(t for o in outs["t1"] for t in o.token_ids)]
    for turn in range(2, 5):
        key = f"t{turn}"
        tokens = [*history, *prompt(4, turn)]
        s.add(key, tokens, greedy(5), user="u")
        step_into(outs, s, r)
        assert s.by_key[key].reused == len(history) - 1, turn  # all but the never-fed last token
        run_into(outs, s, r)
        check_stream(outs[key], reference(tokens, 5))
        history = [*tokens, *(t for o in outs[key] for t in o.token_ids)]
        kept = sorted(p.scope for p in s.table.prefixes.values())
        assert kept == ["u", "v"], turn  # u's latest turn only, and the stranger's untouched


def test_a_cached_donor_is_not_the_prefix_its_copy_evicts() -> None:
    """Every slot holds a cached prefix and a new request copies one of them (tenant: any caller's): the
    slot it needs is made by evicting another, never the one it copies, even though that is the least
    recently used."""
    s, r = make(((2, 128),), prefill_tokens=256, share=8, tenant=True)
    s.add("a", HEAD + prompt(6, 1), greedy(5), user="a", session="SA")
    run(s, r)
    s.add("b", prompt(30, 7), greedy(5), user="b", session="SB")
    run(s, r)
    assert list(s.table.prefixes) == ["SA", "SB"]  # SA least recently used
    c = HEAD + prompt(6, 2)
    s.add("c", c, greedy(5), user="c")
    outs: dict[str, list[StepOutput]] = {}
    step_into(outs, s, r)
    assert s.by_key["c"].reused == len(HEAD)
    assert "SA" in s.table.prefixes and "SB" not in s.table.prefixes
    run_into(outs, s, r)
    check_stream(outs["c"], reference(c, 5))


def test_no_turn_is_kept_without_prefix_reuse_and_no_session_may_look_like_a_kept_turn() -> None:
    s, r = make(((4, 128),), prefill_tokens=256, share=8, reuse=False)
    s.add("t1", HEAD + prompt(6, 1), greedy(5), user="u")
    run(s, r)
    assert s.table.prefixes == {}
    with pytest.raises(ValueError, match="NUL"):
        s.add("x", prompt(5), greedy(3), session="\0turn:t1")


def test_across_users_only_the_public_prefix_is_shared() -> None:
    for public, expected in ((HEAD[:12], 12), (HEAD[:5], 0), ((), 0), ([*HEAD, 1, 2], len(HEAD))):
        s, r = make(((4, 128),), prefill_tokens=256, share=8, public=public)
        outs: dict[str, list[StepOutput]] = {}
        s.add("a", HEAD + prompt(10, 1), greedy(30), user="alice")
        step_into(outs, s, r)
        s.add("b", HEAD + prompt(7, 2), greedy(8), user="bob")
        s.add("c", HEAD + prompt(7, 3), greedy(8), user="alice")
        step_into(outs, s, r)
        assert s.by_key["b"].reused == expected, public
        assert s.by_key["c"].reused == len(HEAD)  # alice's own request: all it has in common
        run_into(outs, s, r)
        check_stream(outs["b"], reference(HEAD + prompt(7, 2), 8))
        check_stream(outs["c"], reference(HEAD + prompt(7, 3), 8))


def test_one_tenant_shares_any_common_start_across_users() -> None:
    """``--prompt-sharing tenant``: every caller one tenant, so bob copies all alice's prompt holds."""
    for user in ("bob", *sorted(POOLED_OWNERS)):
        s, r = make(((4, 128),), prefill_tokens=256, share=8, public=HEAD[:10], tenant=True)
        s.add("a", HEAD + prompt(10, 1), greedy(30), user="alice")
        step(s, r)
        s.add("b", HEAD + prompt(7, 2), greedy(8), user=user)
        step(s, r)
        assert s.by_key["b"].reused == len(HEAD), user
        run(s, r)


def test_pooled_owners_are_strangers_even_to_each_other() -> None:
    """Every keyless HTTP caller is one owner (api.ANONYMOUS_HTTP_OWNER), and so is a request with none:
    their prompts share only the public prefix, as another user's would."""
    for user in sorted(POOLED_OWNERS):
        s, r = make(((4, 128),), prefill_tokens=256, share=8, public=HEAD[:10])
        s.add("a", HEAD + prompt(10, 1), greedy(30), user=user)
        step(s, r)
        s.add("b", HEAD + prompt(7, 2), greedy(8), user=user)
        step(s, r)
        assert s.by_key["b"].reused == 10, user
        run(s, r)


def test_a_cache_key_makes_one_caller_within_a_pooled_owner_only() -> None:
    """OpenAI's ``prompt_cache_key``: a pooled owner's requests with one key share any common start and
    keep their finished turns for the next; another key, or none, gets the public prefix only. A caller
    that is already one (a user) shares across its keys as before. Fair share stays per owner."""
    anon = max(POOLED_OWNERS)
    assert anon
    first = HEAD + prompt(6, 1)
    for user, key2, expected in (
        (anon, "k", "all"),  # same key: its own kept turn, taken over
        (anon, "other", 10),  # another key: a stranger
        (anon, "", 10),  # no key: the pooled owner, a stranger
        ("u", "other", "all"),  # a user is one caller whatever its keys
        ("", "k", "all"),  # the other pooled owner (a request with none) alike
    ):
        s, r = make(((4, 128),), prefill_tokens=256, share=8, public=HEAD[:10])
        s.add("t1", first, greedy(10), user=user, cache_key="k")
        outs = run(s, r)
        assert len(s.table.prefixes) == 1, user  # kept: someone could copy past the public prefix
        reply = [t for o in outs["t1"] for t in o.token_ids]
        second = [*first, *reply, *prompt(5, 2)]
        s.add("t2", second, greedy(6), user=user, cache_key=key2)
        step_into(outs, s, r)
        want = len(first) + len(reply) - 1 if expected == "all" else expected
        assert s.by_key["t2"].reused == want, (user, key2)
        assert s.by_key["t2"].user == user  # fair share: still the owner's
        run_into(outs, s, r)
        check_stream(outs["t2"], reference(second, 6))
        assert {o.cached_tokens for o in outs["t2"]} == {want}


def test_long_shared_starts_are_found_by_block_and_checked_token_by_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Starts longer than a block (scheduler.BLOCK) are matched by chained block hashes; the length is
    exact to the token, and a hash collision (forced here: every block hashes alike) copies nothing the
    tokens do not confirm."""
    from server.engine import scheduler as sched_mod

    base = prompt(3 * sched_mod.BLOCK + 40, 9)
    cut = 2 * sched_mod.BLOCK + 17  # b parts from a inside a's third block
    a = [*base, *prompt(5, 1)]
    b = [*base[:cut], (base[cut] % (VOCAB - 1)) + 1, *base[cut + 1 :]]
    for collide in (False, True):
        if collide:
            monkeypatch.setattr(sched_mod, "hash", lambda _: 7, raising=False)
        s, r = make(((4, 512),), prefill_tokens=512, share=8)
        s.add("a", a, greedy(20), user="u")
        step(s, r)
        s.add("b", b, greedy(8), user="u")
        step(s, r)  # the fake runner checks b's slot holds b's own tokens before it feeds
        assert s.by_key["b"].reused == cut, collide
        outs = run(s, r)
        assert [t for o in outs["b"] for t in o.token_ids] == reference(b, 8)[1:]


def test_nothing_is_copied_from_a_prompt_not_yet_fed_nor_past_the_last_token() -> None:
    s, r = make(((4, 128),), prefill_tokens=256, share=8)
    outs: dict[str, list[StepOutput]] = {}
    p = HEAD + prompt(10, 1)
    s.add("a", p, greedy(30), user="u")
    s.add("b", p, greedy(30), user="u")  # admitted in the same step as a: a has fed nothing yet
    step_into(outs, s, r)
    assert s.by_key["b"].reused == 0
    s.add("c", p, greedy(5), user="u")  # the same prompt: all but its last token, which gives the logits
    step_into(outs, s, r)
    assert s.by_key["c"].reused == len(p) - 1
    run_into(outs, s, r)
    check_stream(outs["c"], reference(p, 5))
    check_stream(outs["b"], reference(p, 30))


def test_a_cached_session_prefix_lends_its_kv_to_another_session_of_its_user() -> None:
    s, r = make(((4, 128),), prefill_tokens=256, share=8)
    s.add("t1", HEAD + prompt(4, 1), greedy(3), session="S1", user="u")
    run(s, r)
    assert "S1" in s.table.prefixes
    s.add("t2", HEAD + prompt(6, 2), greedy(3), session="S2", user="u")
    step(s, r)
    assert s.by_key["t2"].reused == len(HEAD)
    assert "S1" in s.table.prefixes  # lent, not taken
    s.add("t3", HEAD + prompt(6, 3), greedy(3), session="S3", user="v")  # another user, no public prefix
    step(s, r)
    assert s.by_key["t3"].reused == 0
    run(s, r)


def test_slot_table_rejects_bad_pools() -> None:
    with pytest.raises(ValueError):
        SlotTable([(4, 64), (2, 16)])


# ---- property test: random arrivals, finishes and cancels ------------------------------------------

events = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 40), st.integers(0, 3)),
        st.tuples(st.just("add"), st.integers(10, 40), st.integers(10, 40), st.integers(0, 3)),
        st.tuples(st.just("cancel"), st.integers(0, 50), st.just(0), st.just(0)),
        st.tuples(st.just("step"), st.integers(1, 4), st.just(0), st.just(0)),
    ),
    min_size=4,
    max_size=60,
)
pool_sets = st.sampled_from(
    [((6, 128),), ((3, 24), (2, 128)), ((2, 16), (1, 48), (1, 128)), ((4, 16), (1, 128)), ((1, 128),)]
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    evs=events,
    pools=pool_sets,
    budget=st.integers(1, 64),
    max_running=st.integers(1, 6),
    reuse=st.booleans(),
    share=st.sampled_from([0, 1, 4]),
    head=st.integers(0, 24),
)
def test_random_workloads_keep_every_invariant(
    evs: list[tuple[str, int, int, int]],
    pools: tuple[tuple[int, int], ...],
    budget: int,
    max_running: int,
    reuse: bool,
    share: int,
    head: int,
) -> None:
    # Requests without a session start with the same ``head`` tokens, half of them public, and come from
    # four users: KV copied between sequences (share > 0) must be exactly the tokens the fake runner checks.
    common = prompt(head, 77)
    s, r = make(
        pools,
        max_running=max_running,
        prefill_tokens=budget,
        max_waiting=1000,
        reuse=reuse,
        share=share,
        public=common[: head // 2],
    )
    prompts: dict[str, list[int]] = {}
    max_tokens: dict[str, int] = {}
    cancelled: set[str] = set()
    outs: dict[str, list[StepOutput]] = {}
    history: dict[int, list[int]] = {}  # session -> its last prompt + completion

    def do_step() -> None:
        for o in step(s, r):
            assert o.key not in cancelled
            outs.setdefault(o.key, []).append(o)

    for i, (kind, a, b, c) in enumerate(evs):
        if kind == "add":
            key = f"r{i}"
            session = c  # 0: no session
            base = history.get(session, []) if session else []
            # a session's next turn extends its history; the others start alike
            p = (base + prompt(a, i))[-90:] if session else common + prompt(a, i)
            prompts[key], max_tokens[key] = p, b
            s.add(key, p, greedy(b), session=f"S{session}" if session else "", user=f"u{(a + b) % 4}")
            if session:
                history[session] = p + reference(p, b)
        elif kind == "cancel":
            keys = sorted(prompts, key=lambda k: int(k[1:]))
            if keys:
                key = keys[a % len(keys)]
                if s.cancel(key) is not None:
                    cancelled.add(key)
        else:
            for _ in range(a):
                do_step()
    for _ in range(5000):
        if not s.has_work():
            break
        do_step()
    assert not s.has_work()
    assert s.table.running_in(0) == 0
    for key, p in prompts.items():
        if key in cancelled:
            continue
        expected = reference(p, max_tokens[key])
        expected = expected[: 128 - len(p)]  # the context limit ends a request early ("length")
        check_stream(outs[key], expected)
        assert s.by_key.get(key) is None
        assert outs[key][-1].finish == "length"
