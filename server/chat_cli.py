"""``tokenwire chat``: a terminal client that streams replies, keeps the conversation, and rides out a
dropped connection.

When the socket dies mid-reply (a flaky network, a gateway restarting: close 1012), the client reconnects
with its session token and ``hello.resume`` at the offset it has printed, and the reply goes on from
there: nothing repeated, nothing missing. A chat the server never acknowledged is sent again with the
same id (chats are idempotent by id).

Interactive use behaves like the chat tools people know: line editing and history (prompt_toolkit),
Ctrl-C during a reply stops that reply (``cancel``) and returns to the prompt, Ctrl-C or Ctrl-D at the
prompt quits, an empty line is ignored, and ``/help`` lists the commands.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterator
from urllib.parse import urlsplit, urlunsplit

from websockets.exceptions import InvalidStatus, WebSocketException

from protocol import (
    Accepted,
    Cancel,
    Chat,
    Delta,
    Done,
    Error,
    Params,
    ProtocolError,
    ResumePoint,
    parse_client_frame,
)
from server.client import Client, ServerError

RECONNECT_ATTEMPTS = 6
RECONNECT_BASE_S = 0.25  # doubled after each failed attempt, at most 4 s
CANCEL_WAIT_S = 5.0  # after Ctrl-C, how long to wait for the server's done(cancelled) before moving on
WS_PATH = "/v1/ws"
os.environ.setdefault("PROMPT_TOOLKIT_NO_CPR", "1")  # no cursor-position queries: quiet in pipes and tests

HELP = """commands:
  /new              start a new conversation (the server forgets this one's history)
  /settings         show the connection and the sampling settings of this session
  /set NAME VALUE   change a setting: temperature, top_p, top_k, max_tokens, seed,
                    repetition_penalty, frequency_penalty, presence_penalty, model
                    ("/set NAME" resets it)
  /help             this list
  /exit, /quit      leave (or Ctrl-D; Ctrl-C at the prompt)
Ctrl-C during a reply stops it. Up/Down recall earlier lines."""

SETTABLE: dict[str, type] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "max_tokens": int,
    "seed": int,
    "repetition_penalty": float,
    "frequency_penalty": float,
    "presence_penalty": float,
    "model": str,  # one of the server's models (welcome.models)
}


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def check_url(url: str) -> str | None:
    """What is wrong with ``url`` as a chat endpoint, said as a fix (None: nothing seen)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a port out of range)
    except ValueError as exc:
        return f"{url!r} is not a valid URL ({exc}); expected e.g. ws://127.0.0.1:8765{WS_PATH}"
    if parts.scheme in ("http", "https") and parts.netloc:
        ws = urlunsplit(("ws" if parts.scheme == "http" else "wss", parts.netloc, WS_PATH, "", ""))
        return f"{url} is the browser UI's address; chat needs the WebSocket endpoint: tokenwire chat {ws}"
    if parts.scheme not in ("ws", "wss") or not parts.netloc:
        return f"{url!r} is not a WebSocket URL; expected e.g. ws://127.0.0.1:8765{WS_PATH}"
    if parts.path in ("", "/"):
        ws = urlunsplit((parts.scheme, parts.netloc, WS_PATH, "", ""))
        return f"{url} has no endpoint path; the WebSocket endpoint is {WS_PATH}: tokenwire chat {ws}"
    return None


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
        more_tokens_hint: str = "/set max_tokens N",
        context_full_hint: str = "/new starts a new conversation",
    ) -> None:
        self.url = url
        self.more_tokens_hint = more_tokens_hint  # how to ask for more: -m mode has a flag, not /set
        self.context_full_hint = context_full_hint  # what to do instead when the window is full
        self.server_defaults: dict[str, object] = {}  # /config.json's sampling defaults, read once
        self.token = token
        self.write = write
        self.notice = notice
        self.client: Client | None = None
        self.session_token: str | None = None
        self.reconnects = 0
        self.current: str | None = None  # the id of the reply streaming now
        self.cancel_sent = False

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

    async def new_conversation(self) -> Client:
        """Forget this session (and with it the server-side history) and open a fresh one."""
        await self.close()
        self.session_token = None
        return await self.connect()

    async def cancel_current(self) -> bool:
        """Ask the server to stop the reply streaming now; False when there is none (or no connection)."""
        rid, client = self.current, self.client
        if rid is None or client is None or self.cancel_sent:
            return False
        self.cancel_sent = True
        try:
            await client.send(Cancel(id=rid))
        except (OSError, WebSocketException):
            return False  # the connection is gone; the reconnect path ends the reply
        return True

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
        """Stream one reply through ``write``; False if the server reported an error (or never came back).
        A reply stopped by :meth:`cancel_current` ends with a "[stopped]" notice and counts as answered."""
        chat = Chat(id=uuid.uuid4().hex, content=text, params=params)
        self.current, self.cancel_sent = chat.id, False
        try:
            return await self._stream(chat)
        finally:
            self.current = None

    async def _stream(self, chat: Chat) -> bool:
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
                        self.write("\n")
                        if frame.finish_reason == "length" and frame.length_reason == "context":
                            # More tokens would not help (SPEC 12): the conversation fills the window.
                            self.notice(
                                f"[the model's context window is full after {frame.offset} tokens; "
                                f"{self.context_full_hint}]"
                            )
                        elif frame.finish_reason == "length":
                            self.notice(
                                f"[max tokens reached ({frame.offset}); {self.more_tokens_hint} for more]"
                            )
                        elif frame.finish_reason == "cancelled":
                            self.notice("[stopped]")
                        return frame.finish_reason in ("stop", "length", "cancelled")
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
                elif self.cancel_sent:
                    self.cancel_sent = False
                    await self.cancel_current()  # the cancel may have been lost with the connection

    async def close_quietly(self) -> None:
        c, self.client = self.client, None
        if c is not None:
            c.ws.transport.abort()


def _line_reader() -> Callable[[], Awaitable[str]]:
    """A coroutine function returning the next input line: prompt_toolkit (line editing, history) on a
    terminal, plain lines otherwise (pipes, scripts). Raises EOFError at Ctrl-D / end of input and
    KeyboardInterrupt at Ctrl-C."""
    if sys.stdin.isatty() and sys.stdout.isatty():
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory, InMemoryHistory

        from server.engine.model import cache_root

        history: FileHistory | InMemoryHistory
        try:
            cache_root().mkdir(parents=True, exist_ok=True)
            history = FileHistory(str(cache_root() / "chat-history"))
        except OSError:
            history = InMemoryHistory()
        session: PromptSession[str] = PromptSession(history=history)

        async def prompt() -> str:
            return str(await session.prompt_async("> "))

        return prompt

    loop = asyncio.get_running_loop()

    async def plain() -> str:
        line: str = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            raise EOFError
        return line.rstrip("\n")

    return plain


def config_url(ws_url: str) -> str:
    """The server's ``/config.json`` (what the browser UI reads its defaults from) for a chat URL."""
    parts = urlsplit(ws_url)
    return urlunsplit(("https" if parts.scheme == "wss" else "http", parts.netloc, "/config.json", "", ""))


async def fetch_server_defaults(ws_url: str) -> dict[str, object]:
    """The sampling defaults the server applies to a chat that leaves a parameter out, and the default
    model's name ({} when the server does not say: an older one, or a proxy that serves only /v1/ws)."""
    import json
    import urllib.request

    def get() -> dict[str, object]:
        with urllib.request.urlopen(config_url(ws_url), timeout=5) as r:
            body = json.loads(r.read(65536))
        out = dict(body.get("defaults") or {})
        if body.get("model"):
            out["model"] = body["model"]
        return out

    try:
        return await asyncio.get_running_loop().run_in_executor(None, get)
    except (OSError, ValueError, AttributeError):
        return {}


def _settings_text(session: ChatSession, params: Params) -> str:
    welcome = session.client.welcome if session.client else None
    lines = [
        f"server   {session.url}" + (f" ({welcome.server})" if welcome else ""),
        f"session  {welcome.session if welcome else '(not connected)'}",
    ]
    for name in SETTABLE:
        value = getattr(params, name)
        if value is None:
            known = session.server_defaults.get(name)
            value = f"{known} (server default)" if known is not None else "server default"
        lines.append(f"{name:<18} {value}")
    return "\n".join(lines)


def _apply_set(params: Params, args: list[str]) -> tuple[Params, str]:
    if not args or args[0] not in SETTABLE or len(args) > 2:
        return params, f"usage: /set NAME [VALUE] with NAME one of {', '.join(SETTABLE)}"
    name = args[0]
    if len(args) == 1:
        return dataclasses.replace(params, **{name: None}), f"{name}: server default"  # type: ignore[arg-type]
    try:
        value = SETTABLE[name](args[1])
    except ValueError:
        return params, f"{name}: expected {'an integer' if SETTABLE[name] is int else 'a number'}"
    try:
        # The server's own check (SPEC §4.2's ranges), now rather than as an error on the next send.
        parse_client_frame({"type": "chat", "id": "x", "content": "x", "params": {name: value}})
    except ProtocolError as exc:
        return params, str(exc.message) + " (unchanged)"
    return dataclasses.replace(params, **{name: value}), f"{name} = {value}"


@contextlib.contextmanager
def _no_echo() -> Iterator[None]:
    """While a reply streams, what the user types is not echoed into the middle of it: the terminal's
    echo is off (Ctrl-C still works), and the typed text waits in the input buffer for the next prompt."""
    if not sys.stdin.isatty():
        yield
        return
    import termios

    fd = sys.stdin.fileno()
    try:
        old = termios.tcgetattr(fd)
    except termios.error:
        yield
        return
    quiet = list(old)
    quiet[3] &= ~termios.ECHO  # lflag
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, old)


async def _interactive(session: ChatSession, params: Params) -> int:
    read_line = _line_reader()
    loop = asyncio.get_running_loop()
    pending: set[asyncio.Future[bool]] = set()  # cancel sends in flight (kept referenced until done)
    while True:
        try:
            line = (await read_line()).strip()
        except (EOFError, KeyboardInterrupt):
            return 0
        if not line:
            continue
        if line.startswith("/"):
            cmd, *args = line.split()
            if cmd in ("/exit", "/quit"):
                return 0
            if cmd == "/help":
                session.notice(HELP)
            elif cmd == "/new":
                client = await session.new_conversation()
                sid = client.welcome.session if client.welcome else "?"
                session.notice(f"[new conversation: session {sid}]")
            elif cmd == "/settings":
                session.notice(_settings_text(session, params))
            elif cmd == "/set":
                params, said = _apply_set(params, args)
                session.notice(said)
            else:
                session.notice(f"unknown command {cmd}; /help lists them")
            continue
        task = asyncio.ensure_future(session.ask(line, params))

        def on_sigint(task: asyncio.Future[bool] = task) -> None:
            # First Ctrl-C: ask the server to stop (the reply ends with done(cancelled)); a second one, or
            # no answer within CANCEL_WAIT_S, gives up on this reply without waiting further.
            if session.cancel_sent:
                task.cancel()
                return
            pending.add(asyncio.ensure_future(session.cancel_current()))
            loop.call_later(CANCEL_WAIT_S, lambda: task.done() or task.cancel())

        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGINT, on_sigint)
        try:
            with _no_echo():
                await task
        except asyncio.CancelledError:
            session.notice("\n[stopped without the server's answer]")
            await session.close_quietly()  # the stream detaches; the server cancels it after its timeout
        finally:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signal.SIGINT)


async def run_chat(
    url: str,
    *,
    token: str | None = None,
    once: str | None = None,
    temperature: float | None = None,
    max_tokens: int | None = None,
    model: str | None = None,
) -> int:
    session = ChatSession(
        url,
        token=token,
        more_tokens_hint="--max-tokens N" if once is not None else "/set max_tokens N",
        context_full_hint="send a shorter message" if once is not None else "/new starts a new conversation",
    )
    try:
        client = await session.connect()
    except ServerError as exc:
        print(f"tokenwire chat: the server refused: {exc}", file=sys.stderr)
        return 1
    except InvalidStatus as exc:
        code = exc.response.status_code
        print(
            f"tokenwire chat: {url} answered HTTP {code}, not a WebSocket: is {WS_PATH} its endpoint "
            f"(e.g. ws://127.0.0.1:8765{WS_PATH})?",
            file=sys.stderr,
        )
        return 1
    except (OSError, WebSocketException, TimeoutError) as exc:
        print(
            f"tokenwire chat: cannot connect to {url}: {str(exc) or type(exc).__name__}. Is a server "
            f"running there (`make run`)?",
            file=sys.stderr,
        )
        return 1
    params = Params(temperature=temperature, max_tokens=max_tokens, model=model)
    try:
        if once is not None:
            return 0 if await session.ask(once, params) else 1
        session.server_defaults = await fetch_server_defaults(url)
        print(
            f"connected to {url} (session {client.welcome.session if client.welcome else '?'}); "
            "/help for commands, Ctrl-D or /exit to quit",
            file=sys.stderr,
        )
        return await _interactive(session, params)
    finally:
        with contextlib.suppress(Exception):
            await session.close()
