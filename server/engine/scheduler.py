"""Iteration-level scheduling: which sequences feed which tokens in the next step (pure Python, no torch).

Every step, running sequences feed their next token (decode) or their next prompt chunk (prefill), and
waiting sequences are admitted while a slot and the step's prefill budget allow: by token-weighted fair
queueing across users (``fairness.py``: the waiting user with the least service goes first), or in
plain arrival order with ``fair=False``.
``schedule`` returns the step's work, the runner computes it, ``postprocess`` takes the sampled tokens
and turns them into outputs: the engine loop is those three calls.

A sequence is its token list (prompt, then completion) and ``kv_len``, how many of them have their KV in
the cache; it feeds ``tokens[kv_len:]`` — one token when decoding, a chunk when prefilling — and samples
when it reaches the end. Preemption and resume-after-failover are the same thing: KV dropped, kv_len 0,
the tokens fed again (recompute), and sampling carries on at the same completion offset, with the same
per-(seed, offset) randomness.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from server.engine.api import POOLED_OWNERS, SamplingParams, StepOutput, length_reason
from server.engine.detok import Detokenizer
from server.engine.fairness import ServiceCounters
from server.engine.kv_cache import CachedPrefix, Op, SlotRef, SlotTable


class State(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    DONE = "done"


class QueueFull(Exception):
    """The waiting queue is at its bound; come back after ``retry_after_ms``."""

    def __init__(self, retry_after_ms: int) -> None:
        super().__init__(f"waiting queue full; retry after {retry_after_ms} ms")
        self.retry_after_ms = retry_after_ms


# The cached-prefix name of a finished turn that had no session: never a session id (Scheduler.add refuses
# those starting with NUL), so only _admit finds it, by its tokens (_find_donor).
_SESSIONLESS = "\0turn:"


@dataclass(eq=False, slots=True)
class Seq:
    key: str
    tokens: list[int]  # prompt, then every completion token (resumed ones first)
    n_prompt: int
    params: SamplingParams
    detok: Detokenizer
    arrival: int  # admission order: lower goes first
    session: str = ""
    user: str = ""  # whose request: fair share is per user
    # Who its prompt starts are shared with past the public prefix: ``user``, or within a pooled user
    # one of its callers (its prompt_cache_key: Scheduler.add). Fair share stays per ``user``.
    scope: str = ""
    offset: int = 0  # completion tokens already emitted (resumed ones included)
    state: State = State.WAITING
    slot: SlotRef | None = None
    kv_len: int = 0  # tokens[:kv_len] have their KV in the slot
    admitted: bool = False  # admitted at least once (a preempted sequence is not new work)
    preemptions: int = 0
    reused: int = 0  # prompt tokens whose KV came from a cache at its last admission (session or shared)
    cached: int = 0  # prompt tokens whose KV came from a cache at its first admission (usage.cached_tokens)
    blocks: list[int] = field(default_factory=list)  # chained hashes of its tokens' whole blocks (_blocks)

    @property
    def completion_len(self) -> int:
        return len(self.tokens) - self.n_prompt


@dataclass(slots=True)
class Work:
    """One sequence's share of a step: feed tokens[start:start+n]; sample after the last one if
    ``sample`` (the chunk reaches the end of the sequence's tokens)."""

    seq: Seq
    start: int
    n: int
    sample: bool

    @property
    def ids(self) -> list[int]:
        return self.seq.tokens[self.start : self.start + self.n]


@dataclass(slots=True)
class Batch:
    ops: list[Op]  # KV copies to apply, in order, before the forward pass
    work: list[Work]  # decode rows and prefill chunks, the oldest sequence first
    admitted: list[Seq] = field(default_factory=list)  # first admissions this step

    @property
    def sampled(self) -> list[Work]:
        return [w for w in self.work if w.sample]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    pools: tuple[tuple[int, int], ...]  # KV slot pools: (slots, tokens per slot), by increasing length
    max_running: int = 32
    prefill_tokens: int = 256  # prompt tokens fed per step, all chunks together (bounds a step's time)
    # The same budget while any running sequence decodes (None: prefill_tokens). A smaller one here bounds
    # the gap between two tokens of a streaming user when a long prompt arrives; the larger one above
    # still fills an idle engine fast.
    prefill_tokens_decoding: int | None = None
    max_waiting: int = 256  # new requests waiting beyond this are refused (QueueFull)
    eos_ids: frozenset[int] = frozenset()
    prefix_reuse: bool = True
    # A new sequence starts with a copy of the KV of its leading tokens where a running sequence or a
    # cached prefix already holds them, at least ``share_min_tokens`` of them (0, the default here:
    # never; the engine's is 8, EngineConfig). Across users only within ``public_prefix``, the chat
    # template's own opening, the same for everyone: a longer shared prefix would make one user's first
    # token come sooner when another user's prompt starts the same way, a timing signal about that
    # prompt. One user's own requests share any common prefix.
    share_min_tokens: int = 0
    public_prefix: tuple[int, ...] = ()
    # Owners that stand for many callers (api.POOLED_OWNERS): strangers even to each other.
    pooled_users: frozenset[str] = POOLED_OWNERS
    # Every caller one tenant (``--prompt-sharing tenant``): any common start is shared across users.
    share_across_users: bool = False
    fair: bool = True  # token-weighted fair queueing across users; False: strict arrival order (FIFO)
    borrow_rows: int = 4  # fair share: rows past max_running a user under their share may take at once


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        decode: Callable[[Sequence[int]], str],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.decode = decode
        self.table = SlotTable(cfg.pools)
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []  # in arrival order
        self.by_key: dict[str, Seq] = {}
        self.clock = clock
        self._arrivals = 0
        self._admit_times: deque[float] = deque(maxlen=64)
        self.preemptions = 0
        self.borrowed = 0  # admissions past max_running, for a user under their fair share of the batch
        self.service = ServiceCounters()
        self._rows: dict[str, int] = {}  # user -> running sequences
        self._queued: dict[str, int] = {}  # user -> waiting sequences
        self.reused_tokens = 0  # prompt tokens not fed again thanks to session prefix reuse
        self.shared_tokens = 0  # prompt tokens not fed again: their KV copied from another sequence

    @property
    def max_context(self) -> int:
        """Longest sequence (prompt plus completion) a slot holds."""
        return self.table.max_len

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def new_waiting(self) -> int:
        return sum(1 for s in self.waiting if not s.admitted)

    # ---- requests in, requests out -----------------------------------------------------------------

    def add(
        self,
        key: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        resume_ids: Sequence[int] = (),
        session: str = "",
        user: str = "",
        weight: float = 1.0,
        cache_key: str = "",
    ) -> Seq:
        """Queue a request (prompt already within budget) for ``user`` (fair share: their ``weight``).
        ``cache_key``: within a pooled user (many callers), the requests with one key are one caller for
        prompt reuse; elsewhere the user already is one. Raises QueueFull at the waiting bound."""
        if len(prompt_ids) + len(resume_ids) >= self.max_context:
            raise ValueError(f"{key}: {len(prompt_ids) + len(resume_ids)} tokens leave no room in any slot")
        if session.startswith(_SESSIONLESS[0]):
            raise ValueError(f"{key}: a session name may not start with NUL (kept turns' names do)")
        if self.new_waiting() >= self.cfg.max_waiting:
            raise QueueFull(self.retry_after_ms())
        detok = Detokenizer(self.decode, params.stop)
        detok.prime(resume_ids)
        seq = Seq(
            key=key,
            tokens=[*prompt_ids, *resume_ids],
            n_prompt=len(prompt_ids),
            params=params,
            detok=detok,
            arrival=self._arrivals,
            session=session if self.cfg.prefix_reuse else "",
            user=user,
            # NUL never occurs in an owner (a JWT sub, "http:<hex>", the anonymous owner): the pair is
            # unambiguous, and never a pooled name.
            scope=f"{user}\0{cache_key}" if cache_key and user in self.cfg.pooled_users else user,
            offset=len(resume_ids),
        )
        self._arrivals += 1
        self.service.set_weight(user, weight)
        if user not in self._queued:  # joins the queue: an idle period banks no credit
            self.service.lift(user, self._queued, self._rows)
        self._enqueue(seq, len(self.waiting))
        self.by_key[key] = seq
        return seq

    def cancel(self, key: str) -> Seq | None:
        """Drop a request wherever it is; its slot is free for the next step. Returns it if it was known."""
        seq = self.by_key.pop(key, None)
        if seq is None:
            return None
        if seq.state is State.WAITING:
            self._dequeue(seq)
        elif seq.state is State.RUNNING:
            self._stop_running(seq)
            self.table.release(seq)
        seq.state = State.DONE
        return seq

    def retry_after_ms(self) -> int:
        """When a refused request might find room: the recent interval between admissions, since one
        admission frees one waiting place."""
        times = self._admit_times
        if len(times) < 2 or times[-1] <= times[0]:
            return 1000
        interval = (times[-1] - times[0]) / (len(times) - 1)
        return int(min(60_000, max(50, math.ceil(interval * 1000))))

    # ---- the step ----------------------------------------------------------------------------------

    def schedule(self) -> Batch:
        """Choose this step's work: every running sequence's next token or chunk, then admissions."""
        work: list[Work] = []
        budget = self.cfg.prefill_tokens
        busy = self.cfg.prefill_tokens_decoding
        if busy is not None and any(
            seq.state is State.RUNNING and len(seq.tokens) - seq.kv_len == 1 for seq in self.running
        ):
            budget = min(budget, busy)
        for seq in list(self.running):
            if seq.state is not State.RUNNING:
                continue  # preempted by an older sequence earlier in this loop
            remaining = len(seq.tokens) - seq.kv_len
            n = 1 if remaining == 1 else min(remaining, budget)
            if n == 0:
                continue  # a long prefill waits for the next step's budget
            if not self._room(seq, seq.kv_len + n):
                continue  # it was preempted itself
            if remaining > 1:
                budget -= n
            work.append(Work(seq, seq.kv_len, n, seq.kv_len + n == len(seq.tokens)))
        # Memory preemption in fair order may take a sequence older than the one that needed room, after
        # its work was chosen: drop that work.
        work = [w for w in work if w.seq.state is State.RUNNING]
        admitted: list[Seq] = []
        while self.waiting and budget > 0:
            seq = self._head()
            borrow = len(self.running) >= self.cfg.max_running
            if borrow and not self._may_borrow(seq.user):
                break
            if not self._admit(seq):
                break  # nobody overtakes the head of the queue (its user's turn, or the oldest)
            self.borrowed += borrow
            self._dequeue(seq)
            self._insert_running(seq)
            seq.state = State.RUNNING
            if not seq.admitted:
                seq.admitted = True
                # What the caller is told was cached: a preempted sequence computes its prompt again
                # on readmission, but the first admission is what its usage reports (as OpenAI's does).
                seq.cached = min(seq.reused, seq.n_prompt)
                admitted.append(seq)
                self._admit_times.append(self.clock())
                self.service.charge_input(seq.user, len(seq.tokens) - seq.kv_len)
            remaining = len(seq.tokens) - seq.kv_len
            n = min(remaining, budget)
            budget -= n
            work.append(Work(seq, seq.kv_len, n, seq.kv_len + n == len(seq.tokens)))
        return Batch(self.table.take_ops(), work, admitted)

    def postprocess(self, batch: Batch, tokens: Sequence[int]) -> list[StepOutput]:
        """Take the tokens sampled for ``batch.sampled`` (in order); returns the step's outputs and
        frees the slots of finished sequences."""
        outs: list[StepOutput] = []
        for w in batch.work:
            # All first: a finishing sequence's slot is refilled by moving another one, whose fed
            # tokens of this step must be part of the copy.
            w.seq.kv_len = w.start + w.n
        picks = iter(tokens)
        for w in batch.sampled:
            seq = w.seq
            token = next(picks)
            if seq.state is not State.RUNNING:
                continue
            seq.tokens.append(token)
            self.service.charge_output(seq.user)
            out = self._emit(seq, token)
            if out is None:
                continue
            outs.append(out)
            if out.finish is not None:
                self._finish(seq)
        return outs

    def finish_all(self) -> list[Seq]:
        """Drop every request (after an engine failure); returns those that were running or waiting."""
        seqs = [*self.running, *self.waiting]
        for s in seqs:
            self.cancel(s.key)
        return seqs

    # ---- internals ---------------------------------------------------------------------------------

    def _emit(self, seq: Seq, token: int) -> StepOutput | None:
        """The output rules (Detokenizer.push, shared with SimpleEngine): EOS is a completion token
        with no text; stop strings end the text before them; max_tokens counts resumed tokens."""
        p = seq.params
        start = seq.offset
        context_full = len(seq.tokens) >= self.max_context
        n, text, finish = seq.detok.push(
            token,
            eos=token in self.cfg.eos_ids and not p.ignore_eos,
            at_length=seq.completion_len >= p.max_tokens or context_full,
        )
        if n == 0 and finish is None:
            return None
        seq.offset += n
        first = seq.n_prompt + start
        return StepOutput(
            seq.key,
            start,
            n,
            text,
            token_ids=tuple(seq.tokens[first : first + n]),
            finish=finish,
            prompt_tokens=seq.n_prompt,
            cached_tokens=seq.cached,
            length_reason=length_reason(finish, context_full=context_full),
        )

    def _finish(self, seq: Seq) -> None:
        self._stop_running(seq)
        self.by_key.pop(seq.key, None)
        seq.state = State.DONE
        keep = None
        # A session's turn is kept for its next turn. A turn without one (the HTTP doors send the whole
        # conversation each time) is kept too where another request could use its start: the same
        # caller's next turn takes it over (_admit). Either way it holds a slot nobody runs in, the
        # first to go (LRU) when a running sequence needs one.
        name = seq.session or (_SESSIONLESS + seq.key if self._may_share_past_public(seq.scope) else "")
        if name and seq.kv_len > 0:
            # Its ids are the sequence's first kv_len tokens: their whole blocks' hashes carry over.
            ids = seq.tokens[: seq.kv_len]
            keep = CachedPrefix(name, ids, scope=seq.scope, blocks=seq.blocks[: seq.kv_len // BLOCK])
        self.table.release(seq, keep)

    def _may_share_past_public(self, scope: str) -> bool:
        """Whether a prompt start of ``scope``'s (Seq.scope) can be copied past the public prefix by anyone
        (that caller's own requests, or everyone's in one tenant): only then is a finished sessionless
        turn worth keeping."""
        if self.cfg.share_min_tokens <= 0 or not self.cfg.prefix_reuse:
            return False
        return self.cfg.share_across_users or scope not in self.cfg.pooled_users

    def _admit(self, seq: Seq) -> bool:
        """Give the head of the queue a slot: its session's cached prefix when it matches (taken over), or
        a new slot starting with a copy of the longest prompt start another holder has (_find_donor)."""
        first = self.table.pool_for(min(len(seq.tokens) + 1, self.max_context))
        assert first is not None
        pools = range(first, self.table.n_pools())
        prefix = self.table.take_prefix(seq.session)
        if prefix is not None and prefix.slot is not None:
            shared = common_prefix(prefix.ids, seq.tokens, len(seq.tokens) - 1)
            if shared > 0:
                return self._take_over(prefix, seq, shared, first)
            self.table.drop_prefix(prefix)
        best, donor = self._find_donor(seq)
        if isinstance(donor, CachedPrefix):
            if donor.session.startswith(_SESSIONLESS) and donor.scope == seq.scope:
                # The caller's own finished turn (no session: an HTTP conversation sends its history
                # again): its next turn takes the slot over, as a session's does, rather than copy it and
                # keep both.
                self.table.take_prefix(donor.session)
                return self._take_over(donor, seq, best, first)
            self.table.touch(donor)  # most recently used: not the prefix the acquire below evicts
        if not any(self.table.acquire(t, seq) for t in pools):
            return False
        seq.kv_len = seq.reused = 0
        if donor is not None and donor.slot is None:  # evicted all the same (its pool's only prefix)
            best, donor = self._find_donor(seq)
        if donor is not None:
            assert donor.slot is not None  # read now: the acquire may have moved a cached prefix
            self.table.share(donor.slot, seq, best)
            seq.reused = best
            self.shared_tokens += best
        return True

    def _take_over(self, prefix: CachedPrefix, seq: Seq, shared: int, first: int) -> bool:
        """``seq`` continues a finished turn (its session's, or its caller's own kept one): it runs in
        ``prefix``'s slot, whose first ``shared`` positions it has in common. False (the prefix kept for
        later) when no pool from ``first`` has room."""
        assert prefix.slot is not None
        own = prefix.slot[0]
        pools = range(first, self.table.n_pools())
        target = own if own >= first else next((t for t in pools if self.table.can_acquire(t)), None)
        if target is None:
            self.table.remember(prefix)  # no room yet: keep it for when there is
            return False
        prefix.kv_len = min(prefix.kv_len, shared)  # only the shared part is valid here
        self.table.adopt(prefix, seq, target)
        seq.kv_len = seq.reused = prefix.kv_len
        self.reused_tokens += seq.reused
        return True

    def _find_donor(self, seq: Seq) -> tuple[int, Seq | CachedPrefix | None]:
        """The holder of the longest run of ``seq``'s leading tokens whose KV is in a slot (fed, not merely
        scheduled), a running sequence or a cached prefix, and that run's length: at least
        SchedulerConfig.share_min_tokens, at most all but its last token, across users only within the
        public prefix (or any under --prompt-sharing tenant). (0, None) when there is none."""
        if self.cfg.share_min_tokens <= 0:
            return 0, None
        cap = len(seq.tokens) - 1  # its last token is always fed: its logits are the first draw
        public = common_prefix(self.cfg.public_prefix, seq.tokens, cap)
        own = seq.scope not in self.cfg.pooled_users  # one caller: its requests share with each other
        tenant = self.cfg.share_across_users
        best, found = self.cfg.share_min_tokens - 1, None
        donors: list[Seq | CachedPrefix] = [*self.running, *self.table.prefixes.values()]
        for d in donors:
            if d is seq or d.slot is None or d.kv_len <= best:
                continue
            limit = min(d.kv_len, cap if tenant or (own and d.scope == seq.scope) else public)
            if limit <= best:
                continue
            n = _shared_len(_ids(d), d.blocks, seq.tokens, seq.blocks, limit)
            if n > best:
                best, found = n, d
        if found is None:
            return 0, None
        # The block hashes found it; the tokens decide (a hash collision must not copy another's KV).
        if _ids(found)[:best] != seq.tokens[:best]:
            best = common_prefix(_ids(found), seq.tokens, best)
            if best < self.cfg.share_min_tokens:
                return 0, None
        return best, found

    def _room(self, seq: Seq, need: int) -> bool:
        """Make the slot of running ``seq`` hold ``need`` positions: move it to a larger pool, preempting
        newer sequences there if none is free. False if ``seq`` itself had to be preempted."""
        assert seq.slot is not None
        if need <= self.table.slot_len(seq.slot[0]):
            return True
        first = self.table.pool_for(need)
        assert first is not None  # sequences end ("length") before they outgrow the largest slot
        while not any(self.table.promote(seq, t) for t in range(first, self.table.n_pools())):
            victims = [
                s
                for s in self.running
                if s is not seq
                and s.slot is not None
                and s.slot[0] >= first
                and self._order(s) > self._order(seq)
            ]
            if not victims:
                self._preempt(seq)
                return False
            self._preempt(max(victims, key=self._order))
        return True

    def _preempt(self, seq: Seq) -> None:
        """Free ``seq``'s KV and queue it again ahead of every newer request: it will feed its tokens
        again (recompute) and carry on from the same offset."""
        self._stop_running(seq)
        self.table.release(seq)
        seq.kv_len = 0
        seq.state = State.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        i = 0
        while i < len(self.waiting) and self.waiting[i].arrival < seq.arrival:
            i += 1
        self._enqueue(seq, i)  # no lift: being preempted is not arriving

    def _insert_running(self, seq: Seq) -> None:
        # Arrival order, so older sequences are served (and kept) first; a re-admitted preempted one
        # goes back among the old.
        i = len(self.running)
        while i > 0 and self.running[i - 1].arrival > seq.arrival:
            i -= 1
        self.running.insert(i, seq)
        self._rows[seq.user] = self._rows.get(seq.user, 0) + 1

    def _stop_running(self, seq: Seq) -> None:
        self.running.remove(seq)
        _dec(self._rows, seq.user)
        self._forget_idle()

    def _enqueue(self, seq: Seq, index: int) -> None:
        self.waiting.insert(index, seq)
        self._queued[seq.user] = self._queued.get(seq.user, 0) + 1

    def _dequeue(self, seq: Seq) -> None:
        self.waiting.remove(seq)
        _dec(self._queued, seq.user)
        self._forget_idle()

    def _forget_idle(self) -> None:
        if len(self.service.counters) > self.service.prune_at:
            self.service.forget_idle(set(self._rows) | set(self._queued))

    # ---- fair share ----------------------------------------------------------------------------------

    def _order(self, seq: Seq) -> tuple[float, int]:
        """Preemption order: the most served user's newest sequence goes first (FIFO: the newest)."""
        if not self.cfg.fair:
            return (0.0, seq.arrival)
        return (self.service.counter(seq.user), seq.arrival)

    def _share(self, user: str) -> float:
        return self._rows.get(user, 0) / self.service.weight(user)

    def _head(self) -> Seq:
        """Who is admitted next. FIFO: the oldest. Fair: the oldest request of the waiting user with the
        least service (ties: the one holding the smaller weighted share of the batch, then the oldest)."""
        if not self.cfg.fair:
            return self.waiting[0]
        heads: dict[str, Seq] = {}
        for s in self.waiting:
            heads.setdefault(s.user, s)
        return min(
            heads.values(), key=lambda s: (self.service.counter(s.user), self._share(s.user), s.arrival)
        )

    def _may_borrow(self, user: str) -> bool:
        """May ``user``, next in fair order, run past ``max_running`` (a full batch)? Only while it holds a
        smaller weighted share of the batch than another user would after giving one row up, and only up
        to ``borrow_rows`` past the limit. Nobody else is admitted until the batch is back under the
        limit, so the over-share user pays the rows back as its sequences end: a light user's chat gets a
        row in the next step, without waiting for a heavy user's long stream to end and without
        preempting (and recomputing) anything. The condition cannot hold both ways, so two users never
        take rows from each other in turn."""
        if not self.cfg.fair or len(self.running) >= self.cfg.max_running + self.cfg.borrow_rows:
            return False
        need = (self._rows.get(user, 0) + 1) / self.service.weight(user)
        return any(
            v != user and need <= (rows - 1) / self.service.weight(v) for v, rows in self._rows.items()
        )


def _dec(counts: dict[str, int], user: str) -> None:
    n = counts[user] - 1
    if n:
        counts[user] = n
    else:
        del counts[user]


BLOCK = 64  # tokens per block hash (_blocks)


def _blocks(tokens: Sequence[int], memo: list[int], n: int) -> list[int]:
    """Chained hashes of the first ``n`` whole blocks of ``tokens`` (block i's hash covers blocks 0..i),
    kept in ``memo``: a holder's tokens only grow at the end, so a whole block's hash never changes and
    each is computed once in the holder's life."""
    while len(memo) < n:
        i = len(memo)
        memo.append(hash((memo[-1] if memo else 0, *tokens[i * BLOCK : (i + 1) * BLOCK])))
    return memo


def _ids(holder: Seq | CachedPrefix) -> list[int]:
    """The tokens whose KV ``holder``'s slot holds (from its start: only its first kv_len are there)."""
    return holder.tokens if isinstance(holder, Seq) else holder.ids


def _shared_len(a: Sequence[int], a_memo: list[int], b: Sequence[int], b_memo: list[int], cap: int) -> int:
    """How many leading tokens ``a`` and ``b`` have in common, at most ``cap``: a binary search over
    their chained block hashes (equal at block i means equal up to it), then the tokens of one block.
    A scan of every holder token by token took 1,315 ms for one step admitting 20 sequences among 256
    running ones of one user, all starting with the same 7,000 tokens; this, 35 ms (a few hashes and at
    most a block per holder; /tmp script, 2-core EPYC, 2026-12-06)."""
    lo, hi = 0, cap // BLOCK  # lo: whole blocks known equal
    ha, hb = _blocks(a, a_memo, hi), _blocks(b, b_memo, hi)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ha[mid - 1] == hb[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    start = lo * BLOCK
    end = min(cap, start + BLOCK)
    return start + common_prefix(a[start:end], b[start:end], end - start)


def common_prefix(a: Sequence[int], b: Sequence[int], cap: int) -> int:
    n = min(len(a), len(b), cap)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
