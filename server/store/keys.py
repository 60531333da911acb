"""Key names. One prefix per deployment (or per test), so tenants and tests never touch each other's keys."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "tw:"

    def _scoped(self, kind: str, owner: str, id: str) -> str:
        # The owner's length goes first so that no (owner, id) pair can collide with another one,
        # whatever characters a JWT subject or a request id contains.
        return f"{self.prefix}{kind}:{len(owner)}:{owner}:{id}"

    def request(self, owner: str, id: str) -> str:
        return self._scoped("req", owner, id)

    def log(self, owner: str, id: str) -> str:
        return self._scoped("log", owner, id)

    def log_of(self, req_key: str) -> str:
        """The token log of the request whose hash is ``req_key`` (both names end in the same scoped id)."""
        head = f"{self.prefix}req:"
        if not req_key.startswith(head):
            raise ValueError(f"not a request key under {self.prefix!r}: {req_key!r}")
        return f"{self.prefix}log:{req_key[len(head) :]}"

    def inflight(self, owner: str) -> str:
        """Set of an owner's request keys that may still be queued or running (submit.lua prunes it)."""
        return f"{self.prefix}inflight:{len(owner)}:{owner}"

    def rate(self, kind: str, owner: str) -> str:
        """A fixed-window counter of an owner's actions of one kind (chats, resumes), across gateways."""
        return f"{self.prefix}rate:{kind}:{len(owner)}:{owner}"

    @property
    def session_secret(self) -> str:
        """The session-signing secret every gateway on this Redis shares (when none is configured)."""
        return f"{self.prefix}session-secret"

    def history(self, session: str) -> str:
        return f"{self.prefix}hist:{session}"

    def session(self, session: str) -> str:
        return f"{self.prefix}sess:{session}"

    def cache(self, key: str, owner: str | None) -> str:
        """A response-cache entry (the log of a deterministic request), by the hash of its inputs: the
        owner's own (``owner`` given), or shared by all owners (``None``, an operator's explicit choice:
        a shared cache tells anyone whether someone else asked the same thing recently)."""
        if owner is None:
            return f"{self.prefix}cache:*:{key}"
        return self._scoped("cache", owner, key)

    @property
    def queue(self) -> str:
        """The default model's work queue (a stream with one consumer group of workers)."""
        return f"{self.prefix}queue"

    @property
    def queued_count(self) -> str:
        """How many of the default model's requests are queued."""
        return f"{self.prefix}queued"

    def model_queue(self, route: str) -> str:
        """The work queue of one model: ``route`` is "" for the deployment's default model (the
        :attr:`queue` above, so a deployment of one model keeps its keys) or another model's name. Only
        workers holding that model read it."""
        return f"{self.prefix}queue:m:{route}" if route else self.queue

    def model_queued_count(self, route: str) -> str:
        """The queued-requests counter of one model's queue (``route`` as in :meth:`model_queue`)."""
        return f"{self.prefix}queued:m:{route}" if route else self.queued_count

    @property
    def workers(self) -> str:
        """Zset of worker leases: member = worker id, score = lease expiry (ms, Redis clock)."""
        return f"{self.prefix}workers"

    @property
    def workers_load(self) -> str:
        """Hash: worker id -> "running/capacity", for session-affinity routing."""
        return f"{self.prefix}wload"

    @property
    def worker_models(self) -> str:
        """Hash: worker id -> JSON ``{"model", "route"}``, the model that worker holds (written with each
        heartbeat, removed when the worker is reaped); gateways list the models of live workers."""
        return f"{self.prefix}wmodels"

    def worker_queue(self, worker: str) -> str:
        """A worker's own queue: requests routed to it by session affinity."""
        return f"{self.prefix}queue:w:{worker}"

    def worker_requests(self, worker: str) -> str:
        """Set of the request keys a worker is running."""
        return f"{self.prefix}wreqs:{worker}"

    def wake(self, reader: str) -> str:
        return f"{self.prefix}wake:{reader}"
