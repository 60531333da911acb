"""The eval's run: what it asks, how it scores, how it chooses; with the fake engine (its reply echoes the
question and names the seed), then once through ``tokenwire eval`` with the real model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from server.defaults import sampling_defaults
from server.eval import run
from server.eval.cases import Case
from server.eval.checks import contains
from server.eval.run import GRID, Reply, Score, Setting
from tests.fakes import FakeEngine

GREEDY = Setting("g", 0.0)
SAMPLED = Setting("s", 0.7, 0.9, 1.1)


def _case(name: str, question: str, answer: str, kind: str = "fact") -> Case:
    return Case(name, kind, (("user", question),), contains(answer))


def test_plan_runs_greedy_once_and_sampled_per_seed() -> None:
    cases = [_case("a", "q", "x"), _case("b", "q", "x")]
    replies = run.plan([GREEDY, SAMPLED], cases, seeds=3)
    assert [(r.setting.name, r.seed) for r in replies].count(("g", 0)) == 2
    assert len(replies) == 2 + 3 * 2
    assert {r.seed for r in replies if r.setting is SAMPLED} == {0, 1, 2}


def test_generate_check_and_score_with_an_engine() -> None:
    cases = [_case("echo", "please say Paris", "Paris"), _case("miss", "please say Rome", "Berlin", "recall")]
    replies = run.plan([GREEDY, SAMPLED], cases, seeds=2)
    run.generate(FakeEngine(step_s=0.0), replies, max_tokens=8)
    run.check(replies)
    # The fake's reply echoes the question and ends with the request's seed: every request ran, each
    # sampled run with its own seed, through the worker's parameter path.
    assert all(r.finish == "length" and r.tokens == 8 for r in replies)
    sampled = [r for r in replies if r.setting is SAMPLED and r.case.name == "echo"]
    assert len({r.text for r in sampled}) == 2
    scores = run.score(replies)
    assert [s.setting for s in scores] == [GREEDY, SAMPLED]
    g, s = scores
    assert (g.replies, g.passed, s.replies, s.passed) == (2, 1, 4, 2)
    assert g.kind_rate("fact") == 1.0 and g.kind_rate("recall") == 0.0
    assert g.cut == 2 and g.tokens == 16


def _score(name: str, replies: int, passed: int, loops: int) -> Score:
    s = Score(Setting(name, 0.0, repetition_penalty=1.0 + len(name) / 100))
    s.replies, s.passed, s.loops = replies, passed, loops
    return s


def test_choose_takes_the_best_pass_rate_that_rarely_loops() -> None:
    loopy = _score("loopy", 100, 80, 20)  # the best pass rate, but loops on a fifth of its replies
    good = _score("good", 100, 60, 2)
    also = _score("also", 100, 60, 1)  # same pass rate, fewer loops
    worse = _score("worse", 100, 40, 0)
    assert run.choose([loopy, good, also, worse]) is also
    assert run.choose([loopy, good, worse]) is good
    assert run.choose([loopy]) is None
    assert run.choose([loopy], loop_limit=0.25) is loopy
    tie = _score("tie", 100, 60, 2)
    assert run.choose([good, tie]) is good  # a full tie: the earlier setting


def test_the_server_defaults_row_is_what_the_worker_applies() -> None:
    d = run.server_defaults()
    want = sampling_defaults()
    assert (d.temperature, d.top_p, d.repetition_penalty) == (
        want["temperature"],
        want["top_p"],
        want["repetition_penalty"],
    )
    assert d.frequency_penalty == want.get("frequency_penalty", 0.0)
    # The grid always scores the defaults, as a grid setting or as a row of their own.
    assert any(d.same_as(s) for s in run.settings_named("grid"))


def test_settings_and_cases_by_name() -> None:
    assert run.settings_named(f"defaults,{GRID[0].name}")[1] is GRID[0]
    with pytest.raises(ValueError, match="unknown setting"):
        run.settings_named("hot")
    assert {c.kind for c in run.cases_named("code")} == {"code"}
    assert run.cases_named("capital-france,code")[0].name == "capital-france"
    with pytest.raises(ValueError, match="unknown case"):
        run.cases_named("poetry")


def test_a_reply_that_failed_passes_nothing() -> None:
    r = Reply(_case("x", "q", "Paris"), GREEDY, 0, text="Paris", finish="error")
    run.check([r])
    assert not r.passed


@pytest.mark.slow
def test_tokenwire_eval_with_the_real_model(tmp_path: Path) -> None:
    """The command a user runs, in its own process, on the packaged model: two settings, a few cases of
    each kind, the table on stdout and every reply in the JSON."""
    out = tmp_path / "eval.json"
    cases = "capital-france,add-small,reverse-string,yes-no,name"
    done = subprocess.run(
        [sys.executable, "-m", "server.cli", "eval", "--settings", f"defaults,{GRID[0].name}",
         "--cases", cases, "--seeds", "2", "--max-tokens", "64", "--threads", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| setting | pass |" in done.stdout
    assert "chosen:" in done.stdout or "none chosen" in done.stdout
    result = json.loads(out.read_text())
    assert result["max_tokens"] == 64 and result["cases"] == 5
    assert [s["setting"] for s in result["scores"]] == ["server defaults", GRID[0].name]
    n_default = 5 * (1 if run.server_defaults().greedy else 2)
    assert len(result["replies"]) == n_default + 5
    for r in result["replies"]:
        assert r["finish"] in ("stop", "length") and 0 < r["tokens"] <= 64 and r["text"]
    assert result["scores"][0]["replies"] == n_default


def test_benchmarks_md_says_whether_the_defaults_are_the_chosen_setting() -> None:
    from server.load.benchmarks import _render_eval

    def row(name: str, rate: float) -> dict[str, object]:
        kinds = {"fact": rate, "arithmetic": rate, "code": None, "format": rate, "recall": rate}
        return {"setting": name, "pass_rate": rate, "loop_rate": 0.0, "cut_rate": 0.1, "mean_tokens": 80,
                "by_kind": kinds}  # fmt: skip

    ev = {"model": "m", "dtype": "float32", "cases": 40, "seeds": 3, "max_tokens": 256, "seconds": 300.0,
          "scores": [row("greedy", 0.5), row("t=0.2", 0.4)], "chosen": "greedy"}  # fmt: skip
    text = "\n".join(_render_eval({**ev, "server_defaults": "greedy"}))
    assert (
        "| greedy | 50.0% | 50% | 50% | - | 50% | 50% | 0.0% | 10% | 80 | **chosen**, the server's now |"
        in text
    )
    assert "are the chosen setting" in text
    assert "example prompts" not in text  # these rows carry no per-case figures
    text = "\n".join(_render_eval({**ev, "server_defaults": "t=0.2"}))
    assert "**the server's defaults (t=0.2) are not the chosen setting (greedy)**" in text
