"""``tokenwire chat``: a terminal client that streams replies and keeps the conversation."""

from __future__ import annotations

import asyncio
import sys
import uuid

from protocol import Delta, Done, Error, Params
from server.client import Client, ServerError


async def _ask(client: Client, text: str, params: Params) -> bool:
    """Stream one reply to stdout; False if the server reported an error."""
    ok = True
    async for frame in client.chat(text, id=uuid.uuid4().hex, params=params):
        if isinstance(frame, Delta):
            sys.stdout.write(frame.text)
            sys.stdout.flush()
        elif isinstance(frame, Error):
            print(f"\n[error {frame.code}] {frame.message}", file=sys.stderr)
            ok = False
        elif isinstance(frame, Done):
            if frame.finish_reason == "length":
                sys.stdout.write(" [...]")
            print(flush=True)
    return ok


async def run_chat(
    url: str,
    *,
    token: str | None = None,
    once: str | None = None,
    temperature: float | None = None,
    max_tokens: int | None = None,
) -> int:
    try:
        client = await Client.connect(url, token=token)
    except ServerError as exc:
        print(f"tokenwire chat: the server refused: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"tokenwire chat: cannot connect to {url}: {exc}. Is `make run` running?", file=sys.stderr)
        return 1
    params = Params(temperature=temperature, max_tokens=max_tokens)
    try:
        if once is not None:
            return 0 if await _ask(client, once, params) else 1
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
            await _ask(client, line, params)
    except (EOFError, KeyboardInterrupt):
        return 0
    finally:
        await client.close()
