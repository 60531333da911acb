"""Score sampling settings on the eval's cases (cases.py) with a real engine, and choose the defaults.

Every (setting, case, seed) is one request to the same batching engine the worker runs, with the same
chat template and the worker's own parameter path (``params_from_payload``), so a score is what a user
of the server would get with those parameters. Greedy settings run once (one seed gives them all);
sampled ones run ``seeds`` times with different seeds. All requests go in together and the engine
batches them; the checks run afterwards, code in subprocesses.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from server.engine.api import EngineOverloaded, GenerationRequest, StepOutput
from server.engine.prompt import PromptTooLarge
from server.eval.cases import CASES, KINDS, Case
from server.eval.checks import looped
from server.worker.loop import params_from_payload

# A setting may loop on at most this share of its replies to be chosen as the default: loops are what
# a user remembers (256 tokens of one sentence, then fed back as history), and the default must keep
# them rare whatever it gains elsewhere. 2%: no loop in a greedy setting's 40 replies, at most 2 in a
# sampled setting's 120. (At 5% plain greedy won by 2 replies, each a lucky word, while 2 of its 40
# replies looped: the first grid, in issue 29's note.)
LOOP_LIMIT = 0.02


@dataclass(frozen=True, slots=True)
class Setting:
    name: str
    temperature: float
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def payload(self, max_tokens: int, seed: int) -> dict[str, object]:
        """The chat's ``params`` (SPEC 4.2), as a client would send them."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "repetition_penalty": self.repetition_penalty,
            "frequency_penalty": self.frequency_penalty,
            "max_tokens": max_tokens,
            "seed": seed,
        }

    def same_as(self, other: Setting) -> bool:
        """The same sampling: top_p counts only when sampling (greedy decoding never reads it)."""

        def key(s: Setting) -> tuple[float, ...]:
            return (s.temperature, 1.0 if s.greedy else s.top_p, s.repetition_penalty, s.frequency_penalty)

        return key(self) == key(other)


def _named(t: float, p: float, rp: float = 1.0, fp: float = 0.0) -> Setting:
    parts = ["greedy" if t <= 0 else f"t={t:g} top_p={p:g}"]
    if rp != 1.0:
        parts.append(f"rep={rp:g}")
    if fp:
        parts.append(f"freq={fp:g}")
    return Setting(" ".join(parts), t, 1.0 if t <= 0 else p, rp, fp)


# The grid: greedy and two temperatures, each without a penalty, with a mild and a firm repetition
# penalty (1.2 was the default before this eval), and with a frequency penalty instead (which, unlike
# the repetition penalty, leaves the prompt's tokens and the end-of-turn token alone).
GRID: tuple[Setting, ...] = (
    _named(0.0, 1.0),
    _named(0.0, 1.0, rp=1.05),
    _named(0.0, 1.0, rp=1.1),
    _named(0.0, 1.0, rp=1.2),
    _named(0.0, 1.0, fp=0.1),
    _named(0.0, 1.0, fp=0.3),
    _named(0.0, 1.0, fp=0.5),
    _named(0.2, 0.9),
    _named(0.2, 0.9, rp=1.1),
    _named(0.2, 0.9, rp=1.2),
    _named(0.2, 0.9, fp=0.3),
    _named(0.7, 0.9, rp=1.1),
)


def server_defaults() -> Setting:
    """What a chat that sets no parameter gets: read through the worker's own path, not restated."""
    p = params_from_payload({})
    return Setting("server defaults", p.temperature, p.top_p, p.repetition_penalty, p.frequency_penalty)


@dataclass(slots=True)
class Reply:
    case: Case
    setting: Setting
    seed: int
    text: str = ""
    tokens: int = 0
    finish: str = ""
    passed: bool = False
    looped: bool = False


@dataclass(slots=True)
class Score:
    setting: Setting
    replies: int = 0
    passed: int = 0
    loops: int = 0
    cut: int = 0  # finished at max_tokens
    tokens: int = 0
    by_kind: dict[str, list[int]] = field(default_factory=lambda: {k: [0, 0] for k in KINDS})
    by_case: dict[str, list[int]] = field(default_factory=dict)  # case name: [passed, asked]

    @property
    def pass_rate(self) -> float:
        return self.passed / self.replies if self.replies else 0.0

    @property
    def loop_rate(self) -> float:
        return self.loops / self.replies if self.replies else 0.0

    def kind_rate(self, kind: str) -> float:
        passed, total = self.by_kind[kind]
        return passed / total if total else 0.0

    def as_json(self) -> dict[str, object]:
        return {
            "setting": self.setting.name,
            "params": self.setting.payload(0, 0) | {"max_tokens": None, "seed": None},
            "replies": self.replies,
            "pass_rate": round(self.pass_rate, 4),
            "loop_rate": round(self.loop_rate, 4),
            "cut_rate": round(self.cut / self.replies, 4) if self.replies else 0.0,
            "mean_tokens": round(self.tokens / self.replies, 1) if self.replies else 0.0,
            "by_kind": {k: round(self.kind_rate(k), 4) if self.by_kind[k][1] else None for k in KINDS},
            "by_case": self.by_case,
        }


def plan(settings: Sequence[Setting], cases: Sequence[Case], seeds: int) -> list[Reply]:
    """Every request of the run: each case once per greedy setting, ``seeds`` times per sampled one."""
    return [
        Reply(case, s, seed) for s in settings for seed in range(1 if s.greedy else seeds) for case in cases
    ]


def generate(
    engine: Any, replies: Sequence[Reply], max_tokens: int, progress: Callable[[int, int], None] | None = None
) -> None:
    """Run every reply's request on ``engine`` (not yet started) and fill in text, tokens and finish.
    ``progress(finished, total)`` is called on the engine's thread as replies finish."""
    by_key = {f"eval-{i}": r for i, r in enumerate(replies)}
    texts: dict[str, list[str]] = {k: [] for k in by_key}
    done = threading.Semaphore(0)
    finished = [0]

    def on_step(outs: list[StepOutput]) -> None:  # the engine's thread
        for o in outs:
            r = by_key.get(o.key)
            if r is None:
                continue
            if o.n:
                texts[o.key].append(o.text)
                r.tokens += o.n
            if o.finish is not None:
                r.finish = o.finish
                finished[0] += 1
                if progress is not None:
                    progress(finished[0], len(by_key))
                done.release()

    engine.start(on_step)
    try:
        for key, r in by_key.items():
            request = GenerationRequest(
                key=key,
                messages=r.case.chat(),
                params=params_from_payload(r.setting.payload(max_tokens, 1000 * r.seed + 1)),
                session=key,
            )
            try:
                request = engine.prepare(request)
            except PromptTooLarge:  # no case is that long; a --model with a tiny context might be
                r.finish = "error"
                done.release()
                continue
            while True:
                try:
                    engine.submit(request)
                    break
                except EngineOverloaded as exc:
                    time.sleep(exc.retry_after_ms / 1000)
        for _ in by_key:
            done.acquire()
    finally:
        engine.stop()
    for key, r in by_key.items():
        r.text = "".join(texts[key])


def check(replies: Iterable[Reply]) -> None:
    """Run each reply's check and the loop detector."""
    for r in replies:
        r.looped = looped(r.text)
        r.passed = r.finish in ("stop", "length") and r.case.check(r.text)


def score(replies: Iterable[Reply]) -> list[Score]:
    """One score per setting, in the order the settings first appear."""
    scores: dict[Setting, Score] = {}
    for r in replies:
        s = scores.setdefault(r.setting, Score(r.setting))
        s.replies += 1
        s.passed += r.passed
        s.loops += r.looped
        s.cut += r.finish == "length"
        s.tokens += r.tokens
        s.by_kind[r.case.kind][0] += r.passed
        s.by_kind[r.case.kind][1] += 1
        case = s.by_case.setdefault(r.case.name, [0, 0])
        case[0] += r.passed
        case[1] += 1
    return list(scores.values())


def choose(scores: Sequence[Score], loop_limit: float = LOOP_LIMIT) -> Score | None:
    """The default: the highest pass rate among settings that loop on at most ``loop_limit`` of their
    replies; a tie goes to fewer loops, then to the earlier setting of the grid. None when every setting
    loops more than that."""
    ok = [s for s in scores if s.loop_rate <= loop_limit]
    # min keeps the first of equal keys: a full tie goes to the earlier setting.
    return min(ok, key=lambda s: (-s.pass_rate, s.loop_rate), default=None)


def settings_named(spec: str) -> list[Setting]:
    """``--settings``: "grid" (every setting of the grid and the server's defaults), "defaults", or a
    comma-separated list of grid names."""
    defaults = server_defaults()
    if spec == "grid":
        extra = [] if any(defaults.same_as(s) for s in GRID) else [defaults]
        return [*GRID, *extra]
    chosen: list[Setting] = []
    for name in (n.strip() for n in spec.split(",")):
        if name == "defaults":
            chosen.append(defaults)
            continue
        match = [s for s in GRID if s.name == name]
        if not match:
            names = ", ".join(repr(s.name) for s in GRID)
            raise ValueError(f"unknown setting {name!r}: use grid, defaults or one of {names}")
        chosen.append(match[0])
    return chosen


def cases_named(spec: str | None) -> list[Case]:
    """``--cases``: every case (None), or a comma-separated list of case names and kinds."""
    if not spec:
        return list(CASES)
    wanted = {n.strip() for n in spec.split(",") if n.strip()}
    unknown = wanted - {c.name for c in CASES} - set(KINDS)
    if unknown:
        raise ValueError(f"unknown case or kind {sorted(unknown)}: kinds are {', '.join(KINDS)}")
    return [c for c in CASES if c.name in wanted or c.kind in wanted]
