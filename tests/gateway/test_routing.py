"""Rendezvous hashing: stable per session, spread across workers, minimal movement when one leaves."""

from __future__ import annotations

from collections import Counter

from server.gateway.routing import rendezvous


def test_rendezvous_is_stable_balanced_and_moves_little() -> None:
    workers = ["w1", "w2", "w3", "w4"]
    sessions = [f"s{i}" for i in range(2000)]
    first = {s: rendezvous(s, workers) for s in sessions}
    assert first == {s: rendezvous(s, list(reversed(workers))) for s in sessions}  # order-independent
    counts = Counter(first.values())
    assert set(counts) == set(workers) and min(counts.values()) > 2000 / 4 * 0.8
    after = {s: rendezvous(s, ["w1", "w2", "w4"]) for s in sessions}
    moved = [s for s in sessions if first[s] != after[s]]
    assert all(first[s] == "w3" for s in moved)  # only w3's sessions move
    assert rendezvous("s", []) is None
