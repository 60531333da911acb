"""Service counters for token-weighted fair queueing (the Virtual Token Counter of "Fairness in Serving
Large Language Models", Sheng et al., OSDI '24). Pure Python, no torch.

Every user has a counter of the service the engine gave them, in weighted tokens: each prompt token fed
at a request's first admission costs ``input_cost``, each generated token ``output_cost``, both divided
by the user's weight (a paying tier may count double). The scheduler admits the waiting user with the
least counter, so over any interval two users who both keep work waiting receive the same weighted
service, within a bound (see ``server/engine/README.md``: fair share).

A user who was not waiting is **lifted** when a request of theirs joins the queue: their counter becomes
at least the least counter among users already waiting (or, when nobody waits, among users running; or,
with the engine idle, the last such value). So an idle period banks no credit: coming back after an
hour does not let a user take the engine for an hour.
"""

from __future__ import annotations

from collections.abc import Iterable

INPUT_COST = 1.0  # per prompt token fed at first admission
OUTPUT_COST = 2.0  # per generated token: a decode row costs more than a prefill token (the paper's 1:2)
PRUNE_AT = 4096  # forget idle users' counters past this many users (only those the lift would erase)


class ServiceCounters:
    """Per-user weighted service, the lift for users joining the queue, and pruning of idle users."""

    def __init__(self, input_cost: float = INPUT_COST, output_cost: float = OUTPUT_COST) -> None:
        self.input_cost = input_cost
        self.output_cost = output_cost
        self.counters: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.vtime = 0.0  # the last lift level: where a user joining an idle engine starts
        self.prune_at = PRUNE_AT  # sweep idle users when there are more counters than this

    def counter(self, user: str) -> float:
        return self.counters.get(user, 0.0)

    def weight(self, user: str) -> float:
        return self.weights.get(user, 1.0)

    def set_weight(self, user: str, weight: float) -> None:
        """The user's weight (their latest request's); non-positive or non-finite weights count as 1."""
        self.weights[user] = weight if 0 < weight < float("inf") else 1.0

    def lift(self, user: str, waiting: Iterable[str], running: Iterable[str]) -> None:
        """``user`` joins the queue with nothing waiting: raise their counter to the least counter among
        the users waiting (else running, else the last such level). Never lowers it."""
        level = min((self.counter(u) for u in waiting if u != user), default=None)
        if level is None:
            level = min((self.counter(u) for u in running), default=None)
        if level is None:
            level = self.vtime
        self.vtime = level
        if level > self.counter(user):
            self.counters[user] = level

    def charge_input(self, user: str, tokens: int) -> None:
        self.counters[user] = self.counter(user) + self.input_cost * tokens / self.weight(user)

    def charge_output(self, user: str, tokens: int = 1) -> None:
        self.counters[user] = self.counter(user) + self.output_cost * tokens / self.weight(user)

    def forget_idle(self, active: set[str]) -> None:
        """Bound memory: drop idle users whose counter is at or below the lift level (the lift would
        give it back to them anyway, so forgetting them changes nothing)."""
        if len(self.counters) <= self.prune_at:
            return
        for u in [u for u, c in self.counters.items() if u not in active and c <= self.vtime]:
            del self.counters[u]
            self.weights.pop(u, None)
        # Those left are active or ahead of the lift level: sweep again only after as many more arrive.
        self.prune_at = max(PRUNE_AT, 2 * len(self.counters))
