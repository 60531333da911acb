"""Which models a deployment serves and how a chat names one (``params.model``, the HTTP ``model`` field).

A gateway of ``tokenwire serve`` knows the models of its own process from the command line; a cluster's
gateways hold no model and learn them from the workers, which advertise the model they hold next to
their lease (``RequestStore.served_models``). The default model's requests use the deployment's original
queue (route ""), so a chat that names no model can be queued even while no worker is up yet.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import structlog

from protocol import ErrorCode, ProtocolError
from server.store.requests import RequestStore

log = structlog.get_logger(__name__)

DEFAULT_ALIAS = "default"  # names the default model wherever a model name is taken


@dataclass(frozen=True, slots=True)
class Served:
    """A snapshot of the served models: ``names`` with the default first (when known)."""

    names: tuple[str, ...]
    default: str | None  # None: no worker is up to say which model is the default

    def route(self, name: str) -> str:
        """The queue of ``name`` (``Keys.model_queue``): "" for the default model."""
        return "" if name == self.default else name


@dataclass(frozen=True, slots=True)
class Choice:
    """The model a chat goes to: its name (what ``accepted.model`` says) and its queue."""

    name: str
    route: str


class ModelRegistry:
    """The served models, from this process's own (``local``, default first) and the live workers'
    advertisements, re-read from the store at most every ``ttl_s``."""

    def __init__(self, store: RequestStore, local: tuple[str, ...] = (), ttl_s: float = 1.0) -> None:
        self.store = store
        self.local = local
        self.ttl_s = ttl_s
        self._served = Served(local, local[0] if local else None)
        self._at = 0.0
        self._lock = asyncio.Lock()
        # serve: the models whose worker in this process has started. None: a cluster's gateway, which
        # knows only what live workers advertise.
        self.started: Callable[[], Iterable[str]] | None = None

    async def served(self, *, fresh: bool = False) -> Served:
        async with self._lock:
            if fresh or time.monotonic() - self._at > self.ttl_s:
                try:
                    self._served = self._merge(await self.store.served_models())
                except Exception as exc:  # listing models must not fail a chat over a store hiccup
                    log.warning("models.refresh_failed", error=str(exc))
                self._at = time.monotonic()
            return self._served

    async def loading(self) -> tuple[str, ...]:
        """``welcome.loading`` (SPEC §5): the served models that no worker serves yet, whose chats (and
        the replies they were generating) wait in their queue until one does. serve: its own models
        whose worker has not started (the model still loads). A cluster's gateway lists only the models
        live workers advertise, so only the default can be missing: ``("default",)`` while no live
        worker holds it."""
        served = await self.served()
        if self.started is not None:
            up = set(self.started())
            return tuple(n for n in served.names if n in self.local and n not in up)
        return () if served.default is not None else (DEFAULT_ALIAS,)

    def _merge(self, advertised: dict[str, tuple[str, str]]) -> Served:
        default = self.local[0] if self.local else None
        if default is None:
            # The default model is the one workers hold on the default route; a deployment whose
            # workers disagree is misconfigured, and the most common claim wins so every gateway agrees.
            claims = Counter(model for model, route in advertised.values() if route == "")
            if claims:
                default = min(claims, key=lambda m: (-claims[m], m))
        names = [*self.local]
        for model, _route in sorted(advertised.values()):
            if model not in names:
                names.append(model)
        if default is not None and default in names:
            names.remove(default)
            names.insert(0, default)
        return Served(tuple(names), default)

    async def choose(self, name: str | None, id: str | None = None) -> Choice:
        """The model a chat asking for ``name`` (None or "default": the default) goes to; an unknown
        name is ProtocolError ``model_not_found`` about request ``id`` (nothing is created)."""
        served = await self.served()
        if name is None or name == DEFAULT_ALIAS:
            # No worker up yet in a cluster: the request waits in the default queue all the same.
            return Choice(served.default or DEFAULT_ALIAS, "")
        if name not in served.names:
            served = await self.served(fresh=True)  # a worker that came up within the last ttl_s
        if name not in served.names:
            listed = ", ".join(served.names) or "none yet"
            raise ProtocolError(
                ErrorCode.MODEL_NOT_FOUND,
                f"params.model: {name[:80]!r} is not served here; served models: {listed}"[:300],
                id=id,
            )
        return Choice(name, served.route(name))
