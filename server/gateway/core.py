"""The gateway's core, the one thing every door uses: admission, submit and attached streams.

The doors (connection.py: the WebSocket protocol; openai_chat.py and openai_responses.py: the
OpenAI-compatible HTTP API, over http_api.py's routing) depend on this module and on nothing above it;
server.py assembles them. A door turns its wire format into an :class:`~server.gateway.admission.Ask`,
asks :attr:`GatewayCore.admission` once, and hands the grant to :attr:`GatewayCore.submitter` and
:meth:`Streams.follow`; the core holds all the state the rules need (the counters, the degradation
signals), so no door has rules of its own.
"""

from __future__ import annotations

import os
import socket

from protocol import frames
from server.gateway.admission import Admission
from server.gateway.degradation import Degradation
from server.gateway.models import ModelRegistry
from server.gateway.routing import Router
from server.gateway.settings import GatewaySettings
from server.gateway.streams import Streams
from server.gateway.submit import Submitter
from server.store.logs import LogReader, RedisClient
from server.store.requests import RequestStore
from server.store.sessions import SessionStore


class GatewayCore:
    def __init__(
        self,
        store: RequestStore,
        sessions: SessionStore,
        reader_redis: RedisClient,
        settings: GatewaySettings,
        *,
        name: str | None = None,
    ) -> None:
        self.store = store
        self.sessions = sessions
        self.settings = settings
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.models = ModelRegistry(store)  # serve sets .local to its own models
        self.degradation = Degradation(settings, store)
        self.admission = Admission(settings, store, self.degradation.queued)
        self.streams = Streams(store, LogReader(reader_redis, store.keys, self.name))
        self.submitter = Submitter(settings, store, self.models, Router(store), self.degradation)

    def limits(self) -> dict[str, int]:
        """``welcome.limits`` (SPEC §5)."""
        st = self.settings
        return {
            "max_frame_bytes": st.max_frame_bytes,
            "max_tokens": st.max_tokens,
            "max_streams": st.max_streams_per_connection,
            "max_waiting_turns": st.max_waiting_turns_per_session,
            # What params.detach_timeout_ms may usefully ask: within the protocol's bound (SPEC 4.2).
            "max_detach_timeout_ms": min(
                frames.MAX_DETACH_TIMEOUT_MS,
                max(st.max_detach_timeout_ms, self.store.settings.detach_timeout_ms),
            ),
        }

    def start(self) -> None:
        self.streams.start()

    async def stop(self) -> None:
        await self.streams.stop()
