"""``tokenwire chat``: a terminal client that streams replies, keeps the conversation, and rides out a
dropped connection.

When the socket dies mid-reply (a flaky network, a gateway restarting: close 1012), the client reconnects
with its session token and ``hello.resume`` at the offset it has printed, and the reply goes on from
there: nothing repeated, nothing missing. A chat the server never acknowledged is sent again with the
same id (chats are idempotent by id).
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import Callable

from websockets.exceptions import WebSocketException

from protocol import Accepted, Chat, Delta, Done, Error, Params, ResumePoint
from server.client import Client, ServerError

RECONNECT_ATTEMPTS = 6
RECONNECT_BASE_S = 0.25  # doubled after each failed attempt, at most 4 s


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


class ChatSession:
    """One conversation over a connection that is re-opened (and the reply in flight resumed) after a
    drop. ``write`` receives the reply text as it streams."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        write: Callable[[str], None] = _stdout,
        notice: Callable[[str], None] = _stderr,
    ) -> None:
        self.url = url
        self.token = token
        self.write = write
        self.notice = notice
        self.client: Client | None = None
        self.session_token: str | None = None
        self.reconnects = 0

    async def connect(self, resume: tuple[ResumePoint, ...] = ()) -> Client:
        client = await Client.connect(
            self.url, token=self.token, session_token=self.session_token, resume=resume
        )
        assert client.welcome is not None
        self.session_token = client.welcome.session_token
        self.client = client
        return client

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None

    async def _reconnect(self, resume: tuple[ResumePoint, ...]) -> Client:
        delay = RECONNECT_BASE_S
        for attempt in range(1, RECONNECT_ATTEMPTS + 1):
            await asyncio.sleep(delay)
            try:
                client = await self.connect(resume)
                self.reconnects += 1
                return client
            except ServerError as exc:  # e.g. the token expired meanwhile: retrying will not help
                raise ConnectionError(f"the server refused to resume: {exc}") from exc
            except (OSError, WebSocketException, TimeoutError) as exc:
                self.notice(f"[reconnecting, attempt {attempt}: {exc}]")
                delay = min(4.0, delay * 2)
        raise ConnectionError(f"could not reconnect to {self.url}")

    async def ask(self, text: str, params: Params) -> bool:
        """Stream one reply through ``write``; False if the server reported an error (or never came back)."""
        chat = Chat(id=uuid.uuid4().hex, content=text, params=params)
        offset, epoch, accepted = 0, None, False
        client = self.client or await self.connect()
        await client.send(chat)
        while True:
            try:
                async for frame in client.frames_for(chat.id):
                    if isinstance(frame, Accepted):
                        epoch, accepted = frame.epoch, True
                    elif isinstance(frame, Delta):
                        if frame.offset == offset:  # a resumed stream starts exactly where we stopped
                            self.write(frame.text)
                            offset += frame.n
                    elif isinstance(frame, Error):
                        self.notice(f"\n[error {frame.code}] {frame.message}")
                        if frame.code != "too_large":
                            return False  # too_large is followed by done(error); the rest end here
                    elif isinstance(frame, Done):
                        if frame.finish_reason == "length":
                            self.write(" [...]")
                        self.write("\n")
                        return frame.finish_reason in ("stop", "length")
                raise ConnectionError("the stream ended without done")
            except (OSError, WebSocketException) as exc:
                self.notice(f"\n[connection lost: {exc}; reconnecting]")
                await self.close_quietly()
                point = (ResumePoint(chat.id, offset, epoch),) if accepted else ()
                try:
                    client = await self._reconnect(point)
                except ConnectionError as err:
                    self.notice(f"[{err}]")
                    return False
                if not accepted:
                    await client.send(chat)  # never acknowledged: the same id again (idempotent)

    async def close_quietly(self) -> None:
        c, self.client = self.client, None
        if c is not None:
            c.ws.transport.abort()


async def run_chat(
    url: str,
    *,
    token: str | None = None,
    once: str | None = None,
    temperature: float | None = None,
    max_tokens: int | None = None,
) -> int:
    session = ChatSession(url, token=token)
    try:
        client = await session.connect()
    except ServerError as exc:
        print(f"tokenwire chat: the server refused: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"tokenwire chat: cannot connect to {url}: {exc}. Is `make run` running?", file=sys.stderr)
        return 1
    params = Params(temperature=temperature, max_tokens=max_tokens)
    try:
        if once is not None:
            return 0 if await session.ask(once, params) else 1
        print(
            f"connected to {url} (session {client.welcome.session if client.welcome else '?'}); "
            "empty line or Ctrl-D to quit",
            file=sys.stderr,
        )
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, lambda: input("> "))
            if not line.strip():
                return 0
            await session.ask(line, params)
    except (EOFError, KeyboardInterrupt):
        return 0
    finally:
        await session.close()
