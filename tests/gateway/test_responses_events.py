"""Sequence numbers of the Responses API (responses_events.py): for any log, any packing of its entries
into deltas and any resume point, every event has a unique, strictly increasing number, and the text
before the cut plus the text resumed after it is the whole text, with the closing events each once."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.gateway.responses_events import (
    NotABoundary,
    ResponseEvents,
    ResumePoint,
    delta_seq,
    last_seq,
    parse_seq,
    resume_point,
)
from server.store.logs import LogEntry


def log_of(sizes: list[int], finish: str) -> list[LogEntry]:
    entries, o = [], 0
    for i, n in enumerate(sizes):
        entries.append(LogEntry(o, n, f"<{i}:{n}>"))
        o += n
    entries.append(LogEntry(o, 0, "", finish=finish, prompt_tokens=3))
    return entries


def batched(entries: list[LogEntry], cuts: list[int]) -> list[list[LogEntry]]:
    """The entries split into consecutive non-empty batches at the given cut points."""
    points = sorted({c % len(entries) for c in cuts if c % len(entries) > 0})
    out, prev = [], 0
    for p in [*points, len(entries)]:
        out.append(entries[prev:p])
        prev = p
    return out


def stream(
    entries: list[LogEntry], cuts: list[int], at: ResumePoint, state: str = "running"
) -> list[dict[str, Any]]:
    ev = ResponseEvents("resp_x", {"model": "m"}, state, at)
    out = ev.opening()
    for batch in batched(entries, cuts):
        out += ev.feed(batch)
    return out


def text(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5), max_size=12),
    cuts_a=st.lists(st.integers(0, 40), max_size=8),
    cuts_b=st.lists(st.integers(0, 40), max_size=8),
    finish=st.sampled_from(["stop", "length", "error", "cancelled"]),
    pick=st.integers(0, 1000),
)
def test_numbers_are_unique_increasing_and_a_resume_loses_and_repeats_nothing(
    sizes: list[int], cuts_a: list[int], cuts_b: list[int], finish: str, pick: int
) -> None:
    entries = log_of(sizes, finish)
    full = stream(entries, cuts_a, ResumePoint())
    seqs = [e["sequence_number"] for e in full]
    assert seqs[0] == 0 and all(a < b for a, b in itertools.pairwise(seqs))
    whole = "".join(e.text for e in entries)
    assert text(full) == whole
    total, ok = entries[-1].offset, finish in ("stop", "length")
    assert seqs[-1] == last_seq(total, ok)
    # Cut after any event the client received; resume from there with another packing of the log.
    cut = pick % len(full)
    seen, after = full[: cut + 1], seqs[cut]
    at = resume_point(after, total, ended=True, ok=ok)
    rest = stream(entries, cuts_b, at, state="done")
    assert all(e["sequence_number"] > after for e in rest)
    got = [e["sequence_number"] for e in seen + rest]
    assert all(a < b for a, b in itertools.pairwise(got))
    assert text(seen) + text(rest) == whole
    # Every non-delta event exactly once, in the same order as the uncut stream.
    kinds = [e["type"] for e in seen + rest if e["type"] != "response.output_text.delta"]
    assert kinds == [e["type"] for e in full if e["type"] != "response.output_text.delta"]


@given(sizes=st.lists(st.integers(2, 5), min_size=1, max_size=6), inner=st.integers(1, 4))
def test_a_number_inside_an_entry_is_refused(sizes: list[int], inner: int) -> None:
    entries = log_of(sizes, "stop")
    offset = inner % (sizes[0] - 1) + 1  # strictly inside the first entry
    ev = ResponseEvents("resp_x", {}, "done", resume_point(delta_seq(offset), entries[-1].offset, True))
    with pytest.raises(NotABoundary):
        ev.feed(entries)


def test_numbers_the_response_never_had_are_refused() -> None:
    with pytest.raises(ValueError):
        resume_point(-1, 5, ended=False)
    with pytest.raises(ValueError):
        resume_point(delta_seq(6), 5, ended=False)  # past the tokens so far
    assert resume_point(delta_seq(5), 5, ended=False) == ResumePoint(4, 5, 0)
    assert resume_point(last_seq(5, True), 5, ended=True) == ResumePoint(4, 5, 4)
    with pytest.raises(ValueError):
        resume_point(last_seq(5, True) + 1, 5, ended=True)
    with pytest.raises(ValueError):
        resume_point(last_seq(5, False) + 1, 5, ended=True, ok=False)


@given(st.text(max_size=14))
def test_a_sequence_number_in_a_query_is_ascii_digits_or_nothing(raw: str) -> None:
    # str.isdigit() takes U+00B2 (int() refuses it) and other scripts' digits (int() reads U+0661 as 1).
    ok = raw != "" and len(raw) <= 12 and all(c in "0123456789" for c in raw)
    assert parse_seq(raw) == (int(raw) if ok else None)


@pytest.mark.parametrize("raw", ["\u00b2", "\u0661", "1\u00b2", "+1", "-1", " 1", "1_000", "1" * 13])
def test_lookalike_numbers_are_no_sequence_number(raw: str) -> None:
    assert parse_seq(raw) is None
