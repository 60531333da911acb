"""Who holds which KV slot: the bookkeeping half of the KV cache (pure Python, no torch).

The cache is a few *pools* of equal slots (say 52 slots of 512 tokens and 4 of 2048); a sequence holds
one slot, in the smallest pool its tokens fit, and moves to a larger pool when it outgrows its slot.
Running sequences of a pool always hold slots 0..n-1 of it, so the runner attends over them as one
strided view; slots n.. hold cached session prefixes (LRU) or nothing. Keeping that invariant costs a
copy of one slot's live tokens when a sequence leaves from the middle; every such copy is recorded as
an op (Move or Swap) that the runner applies to the tensors before the step's forward pass.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

SlotRef = tuple[int, int]  # (pool, slot)


@dataclass(frozen=True, slots=True)
class Move:
    """Copy the first ``length`` positions of slot ``src`` to ``dst`` (pools may differ)."""

    src: SlotRef
    dst: SlotRef
    length: int


@dataclass(frozen=True, slots=True)
class Swap:
    """Exchange the first ``length`` positions of two slots of one pool."""

    a: SlotRef
    b: SlotRef
    length: int


Op = Move | Swap


class Holder(Protocol):
    """Anything that holds a slot: a running sequence or a cached session prefix."""

    slot: SlotRef | None
    kv_len: int  # positions of the slot that hold valid keys/values


@dataclass(eq=False, slots=True)
class _Placeholder:
    slot: SlotRef | None = None
    kv_len: int = 0


@dataclass(eq=False, slots=True)
class CachedPrefix:
    """The KV of a finished turn, kept for the session's next turn: ``ids`` are the tokens whose KV the
    slot holds (prompt and completion, except the last sampled token, which was never fed)."""

    session: str
    ids: list[int]
    slot: SlotRef | None = None
    kv_len: int = 0
    scope: str = ""  # whose turn it was (Seq.scope): its KV is shared past the public prefix with them only
    blocks: list[int] = field(default_factory=list)  # chained block hashes of ``ids`` (scheduler._blocks)


@dataclass(slots=True)
class _Pool:
    slot_len: int
    holders: list[Holder | None]
    running: int = 0  # slots [0, running) hold running sequences


class SlotTable:
    """Slot ownership for running sequences and cached prefixes, with the ops that keep running slots
    packed at the front of each pool. Every method that changes ownership appends its ops to ``ops``;
    the caller drains them (``take_ops``) and applies them in order."""

    def __init__(self, pools: Sequence[tuple[int, int]]) -> None:
        """``pools``: (number of slots, tokens per slot), in increasing tokens per slot."""
        lens = [length for _, length in pools]
        if not pools or lens != sorted(lens) or any(n <= 0 or ln <= 0 for n, ln in pools):
            raise ValueError(f"pools must be non-empty (slots, length) pairs by increasing length: {pools}")
        self._pools = [_Pool(length, [None] * n) for n, length in pools]
        self.prefixes: OrderedDict[str, CachedPrefix] = OrderedDict()  # session -> prefix, LRU first
        self.ops: list[Op] = []

    # ---- queries -----------------------------------------------------------------------------------

    @property
    def max_len(self) -> int:
        return self._pools[-1].slot_len

    def slot_len(self, pool: int) -> int:
        return self._pools[pool].slot_len

    def pool_for(self, length: int) -> int | None:
        """The smallest pool whose slots hold ``length`` tokens (None: longer than any slot)."""
        for i, p in enumerate(self._pools):
            if p.slot_len >= length:
                return i
        return None

    def running_in(self, pool: int) -> int:
        return self._pools[pool].running

    def n_pools(self) -> int:
        return len(self._pools)

    def capacity(self) -> list[tuple[int, int]]:
        return [(len(p.holders), p.slot_len) for p in self._pools]

    def holder_at(self, ref: SlotRef) -> Holder | None:
        return self._pools[ref[0]].holders[ref[1]]

    def can_acquire(self, pool: int) -> bool:
        """A running slot is available in ``pool`` (possibly by evicting a cached prefix)."""
        p = self._pools[pool]
        return p.running < len(p.holders)

    def take_ops(self) -> list[Op]:
        ops, self.ops = self.ops, []
        return ops

    # ---- running sequences -------------------------------------------------------------------------

    def acquire(self, pool: int, holder: Holder) -> bool:
        """Give ``holder`` (kv_len 0) a running slot in ``pool``; False when every slot runs."""
        p = self._pools[pool]
        if p.running >= len(p.holders):
            return False
        target = p.running
        occupant = p.holders[target]
        if occupant is not None:
            # A cached prefix sits where the next running slot must be: move it to a free slot, making
            # one by evicting this pool's least recently used prefix if there is none.
            free = self._free_slot(pool)
            if free is None:
                victim = self._lru_in(pool)
                if victim is None or victim.slot is None:
                    return False  # the rest are prefixes taken for adoption
                free = victim.slot[1]
                self.drop_prefix(victim)
            if p.holders[target] is not None:
                self.ops.append(Move((pool, target), (pool, free), occupant.kv_len))
                p.holders[free], occupant.slot = occupant, (pool, free)
        p.holders[target] = holder
        holder.slot = (pool, target)
        p.running += 1
        return True

    def release(self, holder: Holder, keep: CachedPrefix | None = None) -> None:
        """``holder`` stops running. With ``keep``, its slot (and KV) pass to that cached prefix."""
        assert holder.slot is not None
        pool, j = holder.slot
        p = self._pools[pool]
        last = p.running - 1
        tail = p.holders[last]
        assert tail is not None and j <= last
        if keep is not None:
            keep.kv_len = holder.kv_len
            if j != last:
                # The kept prefix goes past the running slots; the last running sequence takes its place.
                self.ops.append(Swap((pool, j), (pool, last), max(holder.kv_len, tail.kv_len)))
                p.holders[j], tail.slot = tail, (pool, j)
            p.holders[last] = keep
            keep.slot = (pool, last)
            self.remember(keep)
        else:
            if j != last:
                self.ops.append(Move((pool, last), (pool, j), tail.kv_len))
                p.holders[j], tail.slot = tail, (pool, j)
            p.holders[last] = None
        p.running -= 1
        holder.slot = None

    def promote(self, holder: Holder, pool: int) -> bool:
        """Move a running ``holder`` to a slot of the larger ``pool``, with its KV; False if none is free."""
        assert holder.slot is not None
        old = holder.slot
        stand_in = _Placeholder()
        if not self.acquire(pool, stand_in):
            return False
        assert stand_in.slot is not None
        new = stand_in.slot
        self.ops.append(Move(old, new, holder.kv_len))
        self.release(holder)
        holder.slot = new
        self._pools[new[0]].holders[new[1]] = holder
        return True

    def share(self, src: SlotRef, holder: Holder, length: int) -> None:
        """Start ``holder``'s freshly acquired slot with a copy of the first ``length`` positions of
        ``src``'s KV (leading tokens the two have in common); ``src`` keeps its own."""
        assert holder.slot is not None and holder.kv_len == 0 and src != holder.slot
        assert self.holder_at(src) is not None
        self.ops.append(Move(src, holder.slot, length))
        holder.kv_len = length

    # ---- cached prefixes ---------------------------------------------------------------------------

    def take_prefix(self, session: str) -> CachedPrefix | None:
        """Remove and return the session's cached prefix (its slot stays held until adopt or drop)."""
        return self.prefixes.pop(session, None) if session else None

    def adopt(self, prefix: CachedPrefix, holder: Holder, pool: int) -> bool:
        """``holder`` takes over ``prefix``'s slot and KV, running in ``pool`` (the prefix's pool or a
        larger one). False (prefix dropped) if no running slot is available there."""
        assert prefix.slot is not None
        src_pool, c = prefix.slot
        if pool != src_pool:
            if not self.acquire(pool, holder):
                self.drop_prefix(prefix)
                return False
            assert holder.slot is not None
            self.ops.append(Move(prefix.slot, holder.slot, prefix.kv_len))
            holder.kv_len = prefix.kv_len
            self.drop_prefix(prefix)
            return True
        p = self._pools[pool]
        target = p.running
        assert c >= target  # prefixes never sit in running slots
        if c != target:
            other = p.holders[target]
            if other is None:
                self.ops.append(Move((pool, c), (pool, target), prefix.kv_len))
                p.holders[c] = None
            else:
                self.ops.append(Swap((pool, c), (pool, target), max(prefix.kv_len, other.kv_len)))
                p.holders[c], other.slot = other, (pool, c)
        p.holders[target] = holder
        holder.slot = (pool, target)
        holder.kv_len = prefix.kv_len
        prefix.slot = None
        p.running += 1
        return True

    def touch(self, prefix: CachedPrefix) -> None:
        """Mark a cached prefix most recently used: LRU eviction takes the others first."""
        if self.prefixes.get(prefix.session) is prefix:
            self.prefixes.move_to_end(prefix.session)

    def drop_prefix(self, prefix: CachedPrefix) -> None:
        """Forget a cached prefix and free its slot."""
        if self.prefixes.get(prefix.session) is prefix:
            del self.prefixes[prefix.session]
        if prefix.slot is not None:
            pool, c = prefix.slot
            if self._pools[pool].holders[c] is prefix:
                self._pools[pool].holders[c] = None
            prefix.slot = None

    def cached_tokens(self) -> int:
        return sum(p.kv_len for p in self.prefixes.values())

    def usage(self) -> float:
        """Share of the KV memory (slots weighted by their length) held by running sequences and cached
        prefixes: 0.0 empty, 1.0 every slot taken."""
        total = sum(len(p.holders) * p.slot_len for p in self._pools)
        held = sum(p.slot_len for p in self._pools for h in p.holders if h is not None)
        return held / total

    # ---- internals ---------------------------------------------------------------------------------

    def remember(self, prefix: CachedPrefix) -> None:
        """Keep ``prefix`` (holding a slot past the running ones) as its session's most recent."""
        old = self.prefixes.pop(prefix.session, None)
        if old is not None and old is not prefix:
            self.drop_prefix(old)
        self.prefixes[prefix.session] = prefix  # most recently used last

    def _free_slot(self, pool: int) -> int | None:
        p = self._pools[pool]
        for i in range(p.running, len(p.holders)):
            if p.holders[i] is None:
                return i
        return None

    def _lru_in(self, pool: int) -> CachedPrefix | None:
        for prefix in self.prefixes.values():
            if prefix.slot is not None and prefix.slot[0] == pool:
                return prefix
        return None

    def check(self) -> None:
        """Assert the invariants (tests): running slots packed first, every holder where it says."""
        for i, p in enumerate(self._pools):
            for j, h in enumerate(p.holders):
                if h is None:
                    assert j >= p.running, f"pool {i}: empty slot {j} among running ones"
                    continue
                assert h.slot == (i, j), f"pool {i} slot {j}: holder thinks it is at {h.slot}"
                assert h.kv_len <= p.slot_len, f"pool {i} slot {j}: {h.kv_len} > {p.slot_len} tokens"
                assert isinstance(h, CachedPrefix) == (j >= p.running), f"pool {i} slot {j}: wrong side"
        for prefix in self.prefixes.values():
            assert prefix.slot is not None and self.holder_at(prefix.slot) is prefix
