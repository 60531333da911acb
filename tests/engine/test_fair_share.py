"""Fair share in the scheduler (token-weighted fair queueing, fairness.py) with the fake runner.

The bound these tests check (server/engine/README.md, "Fair share"): while two users f and g both have
requests waiting, their service counters satisfy

    c_f - c_g  <=  max(D0, P / w_f)  +  2 * R * T / w_f

where D0 = c_f - c_g when both became backlogged, P the most prompt tokens one admission charges (input
cost 1 a token), R = max_running + borrow_rows (the most sequences running at once), T the largest
max_tokens (output cost 2 a token), w_f f's weight; and
symmetrically for g. Reason: f is admitted only while it has the least counter among waiting users, so
right after f's last admission c_f <= c_g + P / w_f; after it, c_f grows only by the output of f's
sequences then running — at most R of them, at most T tokens each — while c_g never falls.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.engine.api import StepOutput
from server.engine.fairness import INPUT_COST, OUTPUT_COST, PRUNE_AT, ServiceCounters
from server.engine.scheduler import Scheduler, SchedulerConfig
from tests.engine.test_scheduler import (
    EOS,
    FakeRunner,
    check_stream,
    fake_decode,
    greedy,
    prompt,
    reference,
    step,
)


def make(
    pools: Sequence[tuple[int, int]] = ((16, 128),),
    *,
    max_running: int = 4,
    prefill_tokens: int = 64,
    fair: bool = True,
    borrow_rows: int = 1,
) -> tuple[Scheduler, FakeRunner]:
    cfg = SchedulerConfig(
        pools=tuple(pools),
        max_running=max_running,
        prefill_tokens=prefill_tokens,
        max_waiting=10_000,
        eos_ids=frozenset({EOS}),
        fair=fair,
        borrow_rows=borrow_rows,
    )
    return Scheduler(cfg, fake_decode), FakeRunner(pools)


def rows(s: Scheduler, user: str) -> int:
    return sum(1 for q in s.running if q.user == user)


def waiting_users(s: Scheduler) -> set[str]:
    return {q.user for q in s.waiting}


def drain(s: Scheduler, r: FakeRunner, outs: dict[str, list[StepOutput]], limit: int = 20_000) -> None:
    for _ in range(limit):
        if not s.has_work():
            return
        for o in step(s, r):
            outs.setdefault(o.key, []).append(o)
    raise AssertionError("scheduler did not finish")


# ---- ordering ------------------------------------------------------------------------------------


def test_a_light_user_overtakes_a_heavy_users_backlog_and_fifo_does_not() -> None:
    first_token_step: dict[bool, int] = {}
    for fair in (True, False):
        s, r = make(max_running=2, fair=fair)
        for i in range(12):
            s.add(f"h{i}", prompt(8, i), greedy(20), user="heavy")
        outs: dict[str, list[StepOutput]] = {}
        for _ in range(3):
            for o in step(s, r):
                outs.setdefault(o.key, []).append(o)
        s.add("light", prompt(8, 99), greedy(5), user="light")
        n = 0
        while "light" not in outs:
            for o in step(s, r):
                outs.setdefault(o.key, []).append(o)
            n += 1
        first_token_step[fair] = n
        drain(s, r, outs)
        check_stream(outs["light"], reference(prompt(8, 99), 5))
        for i in range(12):
            check_stream(outs[f"h{i}"], reference(prompt(8, i), 20))  # preempted or not: same tokens
    # Fair: the light user's request borrows a row at once. FIFO: it waits until the twelve heavy requests
    # ahead of it have been admitted.
    assert first_token_step[True] == 1
    assert first_token_step[False] > 50


def test_one_user_alone_gets_the_whole_engine() -> None:
    s, r = make(max_running=4)
    for i in range(10):
        s.add(f"r{i}", prompt(6, i), greedy(8), user="solo")
    while len(s.waiting) > 0:
        have = len(s.running) + len(s.waiting)
        batch = s.schedule()
        assert len(batch.work) == min(4, have)  # work-conserving: no row idle while the user has work
        s.postprocess(batch, r.step(batch))
    assert s.borrowed == 0


def test_a_user_under_its_share_borrows_a_row_and_the_batch_comes_back_under_the_limit() -> None:
    s, r = make(max_running=6, borrow_rows=2)
    for i in range(20):
        s.add(f"a{i}", prompt(6, i), greedy(40), user="A")
    for _ in range(3):
        step(s, r)
    assert rows(s, "A") == 6
    for i in range(20):
        s.add(f"b{i}", prompt(6, 50 + i), greedy(40), user="B")
    step(s, r)
    assert (rows(s, "A"), rows(s, "B")) == (6, 1)  # a borrowed row at once, nothing preempted
    step(s, r)  # B's admission charged its prompt; once A's outputs pass it, B is next again
    assert (rows(s, "A"), rows(s, "B")) == (6, 2)
    before = (6, 2)
    for _ in range(150):
        step(s, r)
        now = (rows(s, "A"), rows(s, "B"))
        assert sum(now) <= 8
        for me, other in ((0, 1), (1, 0)):
            if sum(before) >= 6 and now[me] > before[me]:
                # A full batch grows only for a user under its share, by at most the borrowed rows.
                assert before[me] + 2 <= before[other] and now[me] - before[me] <= 2
        before = now
    assert s.preemptions == 0  # borrowing, not preempting: nothing is recomputed


def test_borrowing_never_swings_back_and_forth() -> None:
    s, r = make(max_running=4, borrow_rows=4)
    for u in ("A", "B"):
        for i in range(30):
            s.add(f"{u}{i}", prompt(6, i), greedy(10), user=u)
    for _ in range(150):
        step(s, r)
        assert len(s.running) <= 4  # equal shares: nobody is under share, so nobody borrows
    assert s.borrowed == 0


def test_weights_split_the_engine_by_tier() -> None:
    s, r = make(max_running=4)
    for i in range(40):
        s.add(f"p{i}", prompt(6, i), greedy(12), user="pro", weight=3.0)
        s.add(f"f{i}", prompt(6, 100 + i), greedy(12), user="free", weight=1.0)
    served = {"pro": 0, "free": 0}
    for _ in range(60):
        for o in step(s, r):
            served["pro" if o.key.startswith("p") else "free"] += o.n
    assert waiting_users(s) == {"pro", "free"}  # both stayed backlogged
    assert 2.5 <= served["pro"] / served["free"] <= 3.5


def test_an_idle_user_comes_back_at_the_current_level_not_with_banked_credit() -> None:
    s, r = make(max_running=1)
    s.add("b0", prompt(6), greedy(4), user="B")
    drain(s, r, {})
    for i in range(30):
        s.add(f"a{i}", prompt(6, i), greedy(10), user="A")
    for _ in range(60):
        step(s, r)  # A is served alone for a while: its counter passes B's by far
    assert s.service.counter("A") > s.service.counter("B") + 100
    for i in range(10):
        s.add(f"b{i + 1}", prompt(6, 60 + i), greedy(10), user="B")
    assert s.service.counter("B") == s.service.counter("A")  # lifted: B's idle time banked nothing
    order: list[str] = []
    while len(order) < 8:
        step(s, r)
        for q in s.running:
            if q.key not in order:
                order.append(q.key)
    # Taking turns from there, not B for the whole time it was away.
    assert [k[0] for k in order].count("a") >= 3


def test_memory_preemption_takes_the_most_served_users_sequence() -> None:
    # One long slot: whichever of the two outgrows the short pool second needs the other's long slot.
    for fair, victim in ((True, "old"), (False, "new")):
        s, r = make(((4, 16), (1, 64)), fair=fair)
        s.add("old", prompt(12), greedy(20), user="served-a-lot")
        s.add("new", prompt(12, 1), greedy(20), user="new-user")
        s.service.counters["served-a-lot"] = 1000.0  # as if it had been served for a long time
        preempted: list[str] = []
        outs: dict[str, list[StepOutput]] = {}
        for _ in range(200):
            if not s.has_work():
                break
            before = s.preemptions
            for o in step(s, r):
                outs.setdefault(o.key, []).append(o)
            if s.preemptions > before:
                preempted += [q.key for q in s.waiting]
        assert preempted and preempted[0] == victim
        check_stream(outs["old"], reference(prompt(12), 20))
        check_stream(outs["new"], reference(prompt(12, 1), 20))


def test_counters_are_weighted_tokens_and_idle_users_are_forgotten() -> None:
    c = ServiceCounters()
    c.set_weight("w2", 2.0)
    c.charge_input("w2", 10)
    c.charge_output("w2", 3)
    assert c.counter("w2") == (INPUT_COST * 10 + OUTPUT_COST * 3) / 2
    c.set_weight("bad", float("nan"))
    assert c.weight("bad") == 1.0
    for i in range(PRUNE_AT + 5):
        c.charge_input(f"u{i}", 1)
    c.lift("late", waiting=[], running=["u0"])
    c.forget_idle(active={"u0"})
    assert set(c.counters) == {"u0", "w2"}  # idle users at or below the lift level go


# ---- the bound -----------------------------------------------------------------------------------


class BoundChecker:
    """Checks the counter bound (module docstring) after every step for every pair of users that had
    work waiting at the start and at the end of every step since the pair became backlogged."""

    def __init__(self, s: Scheduler, p_max: int, t_max: int) -> None:
        self.s = s
        self.p_max = p_max
        self.t_max = t_max
        self.since: dict[tuple[str, str], float] = {}  # pair -> c_f - c_g when the interval began
        self.worst = 0.0  # the largest |c_f - c_g| seen, over the bound's right-hand side

    def slack(self, user: str) -> tuple[float, float]:
        w = self.s.service.weight(user)
        rows = self.s.cfg.max_running + self.s.cfg.borrow_rows
        return INPUT_COST * self.p_max / w, OUTPUT_COST * rows * self.t_max / w

    def step(self, r: FakeRunner) -> list[StepOutput]:
        c = self.s.service.counter
        before = waiting_users(self.s)
        starts = {(f, g): c(f) - c(g) for f in before for g in before if f < g}
        outs = step(self.s, r)
        after = waiting_users(self.s)
        for pair in list(self.since):
            if pair not in starts or not set(pair) <= after:
                del self.since[pair]
        for pair, d0 in starts.items():
            if set(pair) <= after:
                self.since.setdefault(pair, d0)
        for (f, g), d0 in self.since.items():
            d = c(f) - c(g)
            in_f, out_f = self.slack(f)
            in_g, out_g = self.slack(g)
            bound_f = max(d0, in_f) + out_f
            bound_g = max(-d0, in_g) + out_g
            assert d <= bound_f, (f, g, d, bound_f)
            assert -d <= bound_g, (g, f, -d, bound_g)
            self.worst = max(self.worst, d / bound_f, -d / bound_g)
        return outs


def test_two_backlogged_users_stay_within_the_bound_and_fifo_does_not() -> None:
    worst = {}
    for fair in (True, False):
        s, r = make(max_running=2, fair=fair)
        for i in range(30):
            s.add(f"f{i}", prompt(10, i), greedy(10), user="f")
        for i in range(30):
            s.add(f"g{i}", prompt(10, 50 + i), greedy(10), user="g")
        checker = BoundChecker(s, p_max=10, t_max=10)
        try:
            for _ in range(2000):
                if not s.has_work():
                    break
                checker.step(r)
            worst[fair] = checker.worst
        except AssertionError:
            worst[fair] = float("inf")
    assert worst[True] <= 1.0
    assert worst[False] == float("inf")  # FIFO serves all of f's backlog first: the check can fail


arrivals = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "step"]),
        st.integers(0, 2),  # user
        st.integers(1, 24),  # prompt tokens (or steps)
        st.integers(1, 16),  # max_tokens
    ),
    min_size=5,
    max_size=80,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    evs=arrivals,
    max_running=st.integers(1, 5),
    borrow=st.integers(1, 3),
    budget=st.integers(4, 64),
    weights=st.tuples(st.sampled_from([1.0, 2.0, 0.5]), st.sampled_from([1.0, 3.0])),
    pools=st.sampled_from([((12, 64),), ((4, 24), (2, 64)), ((3, 16), (1, 64))]),
)
def test_random_arrivals_keep_backlogged_users_within_the_bound(
    evs: list[tuple[str, int, int, int]],
    max_running: int,
    borrow: int,
    budget: int,
    weights: tuple[float, float],
    pools: tuple[tuple[int, int], ...],
) -> None:
    s, r = make(pools, max_running=max_running, prefill_tokens=budget, borrow_rows=borrow)
    users = ["u0", "u1", "u2"]
    weight = {"u0": weights[0], "u1": weights[1], "u2": 1.0}
    checker = BoundChecker(s, p_max=24, t_max=16)
    prompts: dict[str, tuple[list[int], int]] = {}
    outs: dict[str, list[StepOutput]] = {}

    def do_step() -> None:
        for o in checker.step(r):
            outs.setdefault(o.key, []).append(o)

    for i, (kind, u, a, b) in enumerate(evs):
        if kind == "add":
            key = f"r{i}"
            prompts[key] = (prompt(a, i), b)
            s.add(key, prompt(a, i), greedy(b), user=users[u], weight=weight[users[u]])
        else:
            for _ in range(a % 4 + 1):
                do_step()
    for _ in range(5000):
        if not s.has_work():
            break
        do_step()
    assert not s.has_work()
    for key, (p, n) in prompts.items():
        check_stream(outs[key], reference(p, n)[: 64 - len(p)])  # fairness never changes a stream
