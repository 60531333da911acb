"""A small asyncio Python client for protocol v1 (used by ``tokenwire chat``, tests and tools)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from websockets.asyncio.client import ClientConnection as WebSocket
from websockets.asyncio.client import connect

from protocol import (
    MSGPACK_SUBPROTOCOL,
    Chat,
    ClientFrame,
    Delta,
    Done,
    Error,
    Hello,
    Message,
    Params,
    ResumePoint,
    ServerFrame,
    Welcome,
)
from protocol.connection import ClientConnection


class ServerError(Exception):
    def __init__(self, frame: Error) -> None:
        super().__init__(f"{frame.code}: {frame.message}")
        self.frame = frame


class Client:
    def __init__(self, ws: WebSocket, proto: ClientConnection) -> None:
        self.ws = ws
        self.proto = proto
        self.welcome: Welcome | None = None

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        subprotocol: str = MSGPACK_SUBPROTOCOL,
        token: str | None = None,
        session_token: str | None = None,
        resume: tuple[ResumePoint, ...] = (),
        hello: bool = True,
    ) -> Client:
        ws = await connect(url, subprotocols=[subprotocol], max_size=None, open_timeout=30)  # type: ignore[list-item]
        c = cls(ws, ClientConnection(subprotocol))
        if hello:
            await c.send(Hello(token=token, session_token=session_token, resume=resume))
            first = await c.recv()
            if isinstance(first, Error):
                raise ServerError(first)
            if not isinstance(first, Welcome):
                raise RuntimeError(f"expected welcome, got {first}")
            c.welcome = first
        return c

    async def send(self, frame: ClientFrame) -> None:
        self.proto.send(frame)
        for data in self.proto.data_to_send():
            await self.ws.send(data)

    async def send_raw(self, data: Any, *, encode: bool = True) -> None:
        """Send an arbitrary object (encoded with this subprotocol) or raw bytes/str as one message."""
        if encode:
            self.proto.send_raw(data)
            for d in self.proto.data_to_send():
                await self.ws.send(d)
        else:
            await self.ws.send(data)

    async def recv(self) -> ServerFrame:
        while True:
            events = self.proto.events_received()
            if events:
                # Put the rest back in order; recv returns one frame at a time.
                first, rest = events[0], events[1:]
                self.proto._events[:0] = rest
                return first
            self.proto.receive_data(await self.ws.recv())

    async def chat(
        self,
        content: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        id: str | None = None,
        params: Params | None = None,
    ) -> AsyncIterator[ServerFrame]:
        """Send a chat and yield its frames (accepted, deltas, errors) until and including ``done``."""
        rid = id or uuid.uuid4().hex
        msgs = tuple(Message(m["role"], m["content"]) for m in messages) if messages is not None else None
        await self.send(Chat(id=rid, content=content, messages=msgs, params=params or Params()))
        async for frame in self.frames_for(rid):
            yield frame

    async def frames_for(self, rid: str) -> AsyncIterator[ServerFrame]:
        while True:
            frame = await self.recv()
            if getattr(frame, "id", None) != rid:
                continue
            yield frame
            if isinstance(frame, Done):
                return
            if isinstance(frame, Error) and frame.code not in ("too_large",):
                # An error about this id that is not followed by done (conflict, not_found, ...).
                return

    async def close(self) -> None:
        await self.ws.close()


async def collect(frames: AsyncIterator[ServerFrame]) -> tuple[str, list[Delta], Done | None, list[Error]]:
    """Text, deltas, done and errors of one request's frames."""
    deltas: list[Delta] = []
    errors: list[Error] = []
    done: Done | None = None
    async for f in frames:
        if isinstance(f, Delta):
            deltas.append(f)
        elif isinstance(f, Done):
            done = f
        elif isinstance(f, Error):
            errors.append(f)
    return "".join(d.text for d in deltas), deltas, done, errors
