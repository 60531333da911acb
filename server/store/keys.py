"""Key names. One prefix per deployment (or per test), so tenants and tests never touch each other's keys.

**Partitions and hash tags** (ARCHITECTURE.md, "Redis Cluster"). Every Lua script must touch keys of one
hash slot only, so that it runs on a Redis Cluster. An owner's keys (request hashes, token logs, in-flight
set, rate counters, sessions and their history, the owner's response cache) and the work-queue keys of
that owner's partition (the queue stream, its queued counter, each worker's affinity queue and running
set for it) all carry one hash tag, ``{pN}``, with N = crc32(owner) mod ``partitions``. A request's every
transition is then single-slot, the per-owner in-flight cap stays atomic, and the partitions spread over
the cluster's masters. The worker registry (leases and loads) carries ``{g}``.

With ``partitions == 1`` (a plain Redis: one server holds every slot) the tag is left out and the names are
exactly those of before partitions existed, so a single-Redis deployment keeps its data across the
upgrade. The code path is the same: one partition instead of sixteen.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

# Partitions on a Redis Cluster: enough to spread over a handful of masters, few enough that a worker's
# (or a gateway's log reader's) one blocking read per partition stays cheap. Every process on one
# cluster must use the same number, so it is a constant, not an option.
CLUSTER_PARTITIONS = 16


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "tw:"
    partitions: int = 1

    def __post_init__(self) -> None:
        if self.partitions < 1:
            raise ValueError("partitions must be >= 1")
        if self.partitions > 1 and ("{" in self.prefix or "}" in self.prefix):
            # A brace in the prefix would become the hash tag and put every key in one slot.
            raise ValueError(f"a key prefix may not contain braces on a Redis Cluster: {self.prefix!r}")

    # ---- partitions --------------------------------------------------------------------------------

    def partition(self, owner: str) -> int:
        """The owner's partition: crc32, not hash(), which differs between processes."""
        if self.partitions == 1:
            return 0
        return zlib.crc32(owner.encode()) % self.partitions

    def partition_of(self, key: str) -> int:
        """The partition of a key this class made (0 when there is only one)."""
        if self.partitions == 1:
            return 0
        head = f"{self.prefix}{{p"
        if not key.startswith(head):
            raise ValueError(f"not a partitioned key under {self.prefix!r}: {key!r}")
        return int(key[len(head) : key.index("}", len(head))])

    def _base(self, p: int) -> str:
        return self.prefix if self.partitions == 1 else f"{self.prefix}{{p{p}}}:"

    def _own(self, owner: str) -> str:
        return self._base(self.partition(owner))

    @property
    def _global(self) -> str:
        return self.prefix if self.partitions == 1 else f"{self.prefix}{{g}}:"

    # ---- an owner's keys (the owner's partition) ---------------------------------------------------

    def _scoped(self, kind: str, owner: str, id: str) -> str:
        # The owner's length goes first so that no (owner, id) pair can collide with another one,
        # whatever characters a JWT subject or a request id contains.
        return f"{self._own(owner)}{kind}:{len(owner)}:{owner}:{id}"

    def request(self, owner: str, id: str) -> str:
        return self._scoped("req", owner, id)

    def log(self, owner: str, id: str) -> str:
        return self._scoped("log", owner, id)

    def log_of(self, req_key: str) -> str:
        """The token log of the request whose hash is ``req_key`` (both names end in the same scoped id)."""
        head = self._base(self.partition_of(req_key)) + "req:"
        if not req_key.startswith(head):
            raise ValueError(f"not a request key under {self.prefix!r}: {req_key!r}")
        return f"{head[:-4]}log:{req_key[len(head) :]}"

    def req_of(self, log_key: str) -> str:
        """The request hash of the token log ``log_key`` (the inverse of :meth:`log_of`)."""
        head = self._base(self.partition_of(log_key)) + "log:"
        if not log_key.startswith(head):
            raise ValueError(f"not a log key under {self.prefix!r}: {log_key!r}")
        return f"{head[:-4]}req:{log_key[len(head) :]}"

    def inflight(self, owner: str) -> str:
        """Set of an owner's request keys that may still be queued or running (submit.lua prunes it)."""
        return f"{self._own(owner)}inflight:{len(owner)}:{owner}"

    def rate(self, kind: str, owner: str) -> str:
        """A fixed-window counter of an owner's actions of one kind (chats, resumes), across gateways."""
        return f"{self._own(owner)}rate:{kind}:{len(owner)}:{owner}"

    def history(self, session: str, owner: str) -> str:
        """A session's messages. A session has one owner (its token is signed for that owner), so its keys
        live in the owner's partition and finish.lua appends a turn in the same transition."""
        return self.history_in(self.partition(owner), session)

    def history_in(self, partition: int, session: str) -> str:
        """:meth:`history` by the partition (of the owner's request keys) rather than the owner."""
        return f"{self._base(partition)}hist:{session}"

    def session(self, session: str, owner: str) -> str:
        return self.session_in(self.partition(owner), session)

    def session_in(self, partition: int, session: str) -> str:
        """:meth:`session` by the partition (as :meth:`history_in`): finish.lua counts history bytes there."""
        return f"{self._base(partition)}sess:{session}"

    def cache(self, key: str, owner: str | None, asker: str = "") -> str:
        """A response-cache entry (the log of a deterministic request), by the hash of its inputs: the
        owner's own (``owner`` given), or shared by all owners (``None``, an operator's explicit choice:
        a shared cache tells anyone whether someone else asked the same thing recently). A shared entry
        lives in no owner's partition, so it is read and written outside the request's transitions."""
        if owner is None:
            return f"{self.prefix}cache:*:{key}"  # no tag: shared entries spread over the slots
        return self._scoped("cache", owner, key)

    # ---- the work queue (per partition, per model) --------------------------------------------------

    def queue(self, partition: int = 0, route: str = "") -> str:
        """The shared work queue (a stream) of one partition for one model: ``route`` is "" for the
        deployment's default model (so a deployment of one model keeps its keys) or another model's
        name. Only workers holding that model read it."""
        return f"{self._base(partition)}queue" + (f":m:{route}" if route else "")

    def queued_count(self, partition: int = 0, route: str = "") -> str:
        """How many of the partition's requests for one model are queued (not yet started)."""
        return f"{self._base(partition)}queued" + (f":m:{route}" if route else "")

    def model_queue(self, route: str, partition: int = 0) -> str:
        return self.queue(partition, route)

    def model_queued_count(self, route: str, partition: int = 0) -> str:
        return self.queued_count(partition, route)

    def worker_queue(self, worker: str, partition: int = 0) -> str:
        """A worker's own queue in one partition: requests routed to it by session affinity."""
        return f"{self._base(partition)}queue:w:{worker}"

    def worker_requests(self, worker: str, partition: int = 0) -> str:
        """Hash of the requests (of one partition) a worker is running: the token log's key -> the tokens
        logged so far (its end offset). The fence of every write: a worker appends to a log only while it
        is a field here, at exactly its value; every transition that takes a request from the worker
        (finish, cancel, re-queue, reap, the detach timeout) removes it in the same script. (Named
        ``held:``; a set named ``wreqs:`` before step writes, so an old key is never misread.)"""
        return f"{self._base(partition)}held:{worker}"

    def wake(self, reader: str, partition: int = 0) -> str:
        """A log reader's wake-up stream, in the partition of the logs it reads with it."""
        return f"{self._base(partition)}wake:{reader}"

    # ---- global keys ---------------------------------------------------------------------------------

    @property
    def session_secret(self) -> str:
        """The session-signing secret every gateway on this Redis shares (when none is configured)."""
        return f"{self._global}session-secret"

    @property
    def workers(self) -> str:
        """Zset of worker leases: member = worker id, score = lease expiry (ms, Redis clock)."""
        return f"{self._global}workers"

    @property
    def workers_load(self) -> str:
        """Hash: worker id -> "running/capacity", for session-affinity routing."""
        return f"{self._global}wload"

    @property
    def worker_models(self) -> str:
        """Hash: worker id -> JSON ``{"model", "route"}``, the model that worker holds (written with each
        heartbeat, removed when the worker is reaped); gateways list the models of live workers."""
        return f"{self._global}wmodels"
