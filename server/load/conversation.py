"""One simulated user's conversation: a session of ``turns`` chat requests on one connection.

Each request is measured from the client's side (time to first token from sending ``chat``, inter-token
latency per token between consecutive deltas) and, when the run plans it, its connection is killed at a
random token offset mid-stream. The user then reconnects with its session token and ``hello.resume`` at
the offset it holds, exactly as a phone that lost signal would, and the stream must go on without a gap or
a repeat (see ``integrity``). Unplanned disconnects are handled the same way and counted apart.
"""

from __future__ import annotations

import asyncio
import functools
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from websockets.exceptions import WebSocketException

from protocol import Accepted, Chat, Delta, Done, Error, Message, Params, ProtocolError, Resume, ResumePoint
from server.load.connection import LoadClient, ServerError
from server.load.integrity import StreamCheck, Violation, replay_and_compare

if TYPE_CHECKING:
    from server.load.options import LoadConfig
    from server.load.runner import RunState

MAX_CONNECT_FAILURES = 6
REPLAY_ATTEMPTS = 3

TOPICS = (
    "the history of the printing press",
    "how vaccines train the immune system",
    "why the sky is blue",
    "the rules of chess",
    "baking sourdough bread",
    "what a hash table is",
    "the water cycle",
    "how a bicycle stays upright",
    "the life of honey bees",
    "how compilers work",
)
WORDS = (
    "please",
    "explain",
    "briefly",
    "and",
    "clearly",
    "with",
    "one",
    "example",
    "about",
    "how",
    "why",
    "when",
    "where",
    "the",
    "a",
    "of",
    "in",
    "on",
    "for",
    "to",
    "and",
    "or",
    "but",
    "because",
    "history",
    "science",
    "river",
    "mountain",
    "engine",
    "memory",
    "network",
    "language",
    "music",
    "garden",
    "city",
    "winter",
    "summer",
    "light",
    "sound",
    "number",
    "story",
    "question",
    "answer",
    "simple",
    "detail",
)


def prompt_text(rng: random.Random, words: int, turn: int) -> str:
    """A user turn of about ``words`` words (seeded: the same run draws the same prompts)."""
    head = f"Tell me about {rng.choice(TOPICS)}." if turn == 0 else "Go on, and add more detail."
    n = max(0, words - len(head.split()))
    return " ".join([head, *(rng.choice(WORDS) for _ in range(n))])


def system_prompt(cfg: LoadConfig) -> str:
    """The run's fixed system prompt of ``--system-words`` words ("" for none): one app's own prompt, the
    same for every user and conversation of a run (seeded by ``--seed`` alone)."""
    return _system_text(cfg.system_words, cfg.seed)


def openai_headers(cfg: LoadConfig) -> dict[str, str]:
    """The OpenAI doors' Authorization: ``--token``, else a fixed load key (every user one owner), or none
    with ``--keyless`` (the server's one anonymous owner while auth is off, as keyless apps are)."""
    return {} if cfg.keyless else {"Authorization": f"Bearer {cfg.token or 'tokenwire-load'}"}


def openai_cache_key(cfg: LoadConfig, user: int, conversation: int) -> dict[str, str]:
    """With ``--prompt-cache-key``, the body field naming this conversation (OpenAI's
    ``prompt_cache_key``): the run's seed, the user and the conversation."""
    if not cfg.prompt_cache_key:
        return {}
    return {"prompt_cache_key": f"load-{cfg.seed}-{user}-{conversation}"}


@functools.cache
def _system_text(words: int, seed: int) -> str:
    # Drawn once per run, not once per conversation: up to 4,000 words, and the load client shares the
    # machine with the server it measures.
    if words <= 0:
        return ""
    rng = random.Random(f"system-{seed}")
    head = "You are the assistant of a travel app. Answer briefly and kindly, and follow these notes:"
    n = max(0, words - len(head.split()))
    return " ".join([head, *(rng.choice(WORDS) for _ in range(n))])


@dataclass(slots=True)
class RequestRecord:
    """What the client saw of one request. Times are seconds since the run's start."""

    id: str
    user: int
    conversation: int
    turn: int
    subprotocol: str
    max_tokens: int
    prompt_words: int
    kill_at: int | None = None
    sent_at: float | None = None
    first_at: float | None = None
    done_at: float | None = None
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, those the server reports it did not compute (usage)
    finish_reason: str | None = None
    # With finish_reason "length": "max_tokens" or "context" as the server said (done.length_reason,
    # SPEC 12); None where it said neither (the OpenAI doors have no such field).
    length_reason: str | None = None
    error_code: str | None = None
    kills: int = 0
    resumes: int = 0
    reconnects: int = 0
    retries: int = 0
    resume_failed: int = 0
    verified: bool = False
    itl: list[float] = field(default_factory=list)  # seconds, one entry per token after the first delta
    violations: list[Violation] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error_code is None and self.finish_reason in ("stop", "length")

    @property
    def ttft(self) -> float | None:
        if self.sent_at is None or self.first_at is None:
            return None
        return self.first_at - self.sent_at


def conversation_rng(seed: int, user: int, conversation: int) -> random.Random:
    """The generator a conversation draws its requests from (see ``draw_request``)."""
    return random.Random(f"{seed}:{user}:{conversation}")


def draw_request(
    cfg: LoadConfig,
    rng: random.Random,
    tag: str,
    user: int,
    conversation: int,
    turn: int,
    subprotocol: str,
) -> tuple[Chat, RequestRecord]:
    """The next chat of a conversation, drawn from its seeded ``rng``: prompt, lengths, sampling seed and
    (with ``--drop-rate``) the token at which its connection will be killed. The engine-only run draws
    through here too, so both runs of ``make bench`` ask for exactly the same work."""
    words = cfg.prompt_words.draw(rng, 4000)
    max_tokens = cfg.max_tokens.draw(rng, 8192)
    kill_at = rng.randint(1, max(1, max_tokens - 1)) if rng.random() < cfg.drop_rate else None
    rid = f"{tag}-{user}-{conversation}-{turn}"
    chat = Chat(
        id=rid,
        content=prompt_text(rng, words, turn),
        params=Params(
            max_tokens=max_tokens,
            temperature=cfg.temperature,
            seed=rng.getrandbits(62),
            cache=None if cfg.cache else False,
        ),
    )
    rec = RequestRecord(
        id=rid,
        user=user,
        conversation=conversation,
        turn=turn,
        subprotocol=subprotocol,
        max_tokens=max_tokens,
        prompt_words=words,
        kill_at=kill_at,
    )
    return chat, rec


class _Killed(Exception):
    """The load tool itself dropped the connection (a planned kill)."""


@dataclass(slots=True)
class _Live:
    chat: Chat
    check: StreamCheck
    kill_at: int | None
    epoch: int | None = None
    accepted: bool = False
    sent: bool = False
    last_delta: float | None = None
    pending_error: str | None = None


class Conversation:
    def __init__(self, state: RunState, user: int, conversation: int, subprotocol: str) -> None:
        self.state = state
        self.user = user
        self.conversation = conversation
        self.subprotocol = subprotocol
        cfg = state.cfg
        self.rng = conversation_rng(cfg.seed, user, conversation)
        self.client: LoadClient | None = None
        self.session_token: str | None = None
        # With --system-words the conversation is sent whole (messages mode), this its history so far;
        # otherwise each turn is content only and the server keeps the session's history.
        self.system = system_prompt(cfg)
        self.history: list[Message] = [Message("system", self.system)] if self.system else []

    async def run(self) -> None:
        """Run the turns while the run hands out tickets; stop at the first failed request."""
        cfg = self.state.cfg
        try:
            for turn in range(cfg.turns):
                if turn and cfg.think > 0:
                    await asyncio.sleep(self.rng.expovariate(1.0 / cfg.think))
                if not self.state.take_ticket():
                    return
                rec = await self._request(turn)
                self.state.finish(rec)
                if not rec.ok:
                    return
        finally:
            await self._drop_client(graceful=True)

    async def _drop_client(self, *, graceful: bool = False) -> None:
        c, self.client = self.client, None
        if c is None:
            return
        if graceful:
            try:
                async with asyncio.timeout(2):
                    await c.close()
                return
            except (TimeoutError, OSError, WebSocketException):
                pass
        c.abort()

    async def _connect(self, resume: tuple[ResumePoint, ...]) -> LoadClient:
        c = await LoadClient.open(
            self.state.cfg.url,
            self.subprotocol,
            token=self.state.cfg.token,
            session_token=self.session_token,
            resume=resume,
            coalesce_ms=self.state.cfg.coalesce_ms or None,
        )
        assert c.welcome is not None
        self.session_token = c.welcome.session_token
        self.state.saw_server(c.welcome.server)
        return c

    def _new_request(self, turn: int) -> tuple[RequestRecord, _Live]:
        chat, rec = draw_request(
            self.state.cfg, self.rng, self.state.tag, self.user, self.conversation, turn, self.subprotocol
        )
        if self.system:
            assert chat.content is not None
            chat = Chat(
                id=chat.id, messages=(*self.history, Message("user", chat.content)), params=chat.params
            )
        return rec, _Live(chat=chat, check=StreamCheck(chat.id), kill_at=rec.kill_at)

    async def _request(self, turn: int) -> RequestRecord:
        rec, live = self._new_request(turn)
        try:
            async with asyncio.timeout(self.state.cfg.request_timeout):
                await self._until_done(rec, live)
                if self.system and live.chat.messages is not None:
                    self.history = [*live.chat.messages, Message("assistant", live.check.text)]
                if rec.finish_reason is not None and self._wants_replay(rec):
                    await self._replay(live.check)
                    rec.verified = True
        except TimeoutError:
            rec.error_code = rec.error_code or "timeout"
            await self._drop_client()  # frames of this request may still be on the way
        rec.violations = list(live.check.violations)
        return rec

    def _wants_replay(self, rec: RequestRecord) -> bool:
        verify = self.state.cfg.verify
        disturbed = rec.kills or rec.reconnects or rec.resume_failed
        return verify == "all" or (verify == "drops" and bool(disturbed))

    async def _until_done(self, rec: RequestRecord, live: _Live) -> None:
        failures = 0
        deadline = self.state.now() + self.state.cfg.request_timeout
        while True:
            if self.state.now() > deadline:
                # Normally the enclosing asyncio.timeout fires first; this guards against a library call
                # that turned that cancellation into a connection error we then retried.
                raise TimeoutError
            if self.client is None:
                point = (ResumePoint(live.chat.id, live.check.offset, live.epoch),) if live.accepted else ()
                try:
                    self.client = await self._connect(point)
                except ServerError as exc:
                    rec.error_code = exc.frame.code
                    return
                except (ProtocolError, RuntimeError):
                    rec.error_code = "bad_server_frame"  # the server answered hello with nonsense
                    return
                except (OSError, WebSocketException, TimeoutError) as exc:
                    failures += 1
                    self.state.connect_error = str(exc) or type(exc).__name__
                    if failures > MAX_CONNECT_FAILURES:
                        rec.error_code = "connect_failed"
                        return
                    await asyncio.sleep(min(2.0, 0.05 * 2**failures))
                    continue
                if live.accepted:
                    rec.resumes += 1
                    self.state.resumes += 1
                elif live.sent:
                    live.sent = False  # never accepted: send the same chat again (idempotent by id)
                    rec.retries += 1
                live.last_delta = None  # a gap across a reconnect is not inter-token latency
            try:
                await self._pump(self.client, rec, live)
                return
            except (_Killed, OSError, WebSocketException) as exc:
                if not isinstance(exc, _Killed):
                    rec.reconnects += 1
                await self._drop_client()
            except ProtocolError:
                # A server frame that does not validate: a client cannot repair a broken server.
                rec.error_code = "bad_server_frame"
                await self._drop_client()
                return

    async def _pump(self, client: LoadClient, rec: RequestRecord, live: _Live) -> None:
        """Send the chat if needed, then read this request's frames until ``done`` or an ending error."""
        st, rid, check = self.state, live.chat.id, live.check
        if not live.sent:
            await client.send(live.chat)
            live.sent = True
            if rec.sent_at is None:
                rec.sent_at = st.now()
        while True:
            frame, size = await client.recv_sized()
            if getattr(frame, "id", None) != rid:
                continue
            now = st.now()
            if isinstance(frame, Delta):
                st.wire.delta(client.subprotocol, size, frame)
                check.delta(frame)
                if rec.first_at is None:
                    rec.first_at = now
                elif live.last_delta is not None:
                    rec.itl.extend([(now - live.last_delta) / frame.n] * frame.n)
                live.last_delta = now
                st.add_tokens(frame.n, now)
                if live.kill_at is not None and check.offset >= live.kill_at:
                    live.kill_at = None
                    rec.kills += 1
                    st.kills += 1
                    client.abort()
                    raise _Killed
            elif isinstance(frame, Accepted):
                check.epoch(live.epoch, frame.epoch)
                st.wire.accepted(frame, first=not live.accepted)
                live.epoch, live.accepted = frame.epoch, True
            elif isinstance(frame, Done):
                check.done(frame)
                st.wire.done(frame)
                rec.done_at = now
                rec.tokens = frame.offset
                rec.prompt_tokens = frame.usage.prompt_tokens
                rec.cached_tokens = frame.usage.cached_tokens
                rec.finish_reason = frame.finish_reason
                rec.length_reason = frame.length_reason
                if frame.finish_reason == "error":
                    rec.error_code = live.pending_error or "finish_error"
                elif frame.finish_reason == "cancelled":
                    rec.error_code = "cancelled"
                return
            elif isinstance(frame, Error):
                if frame.code in ("overloaded", "rate_limited") and not live.accepted:
                    rec.retries += 1
                    await asyncio.sleep((frame.retry_after_ms or 1000) / 1000)
                    await client.send(live.chat)  # the same id: an idempotent retry
                elif frame.code == "resume_failed":
                    # The log we held is gone (epoch changed): discard our text, start over from 0.
                    rec.resume_failed += 1
                    check.restart()
                    live.epoch, live.last_delta = None, None
                    await client.send(Resume(id=rid, offset=0))
                elif frame.code == "too_large" or (frame.code == "internal" and live.accepted):
                    live.pending_error = frame.code  # a done with finish_reason error follows
                else:
                    rec.error_code = frame.code
                    return

    async def _replay(self, check: StreamCheck) -> None:
        for attempt in range(REPLAY_ATTEMPTS):
            try:
                if self.client is None:
                    self.client = await self._connect(())
                await replay_and_compare(self.client, check)
                return
            except (OSError, WebSocketException, ServerError, ProtocolError, RuntimeError) as exc:
                await self._drop_client()
                if attempt == REPLAY_ATTEMPTS - 1:
                    check.violations.append(Violation(check.request_id, "replay_failed", repr(exc)[:200]))
