"""``tokenwire load --api openai URL``: the same seeded workload over OpenAI's streaming chat completions.

Each conversation holds one keep-alive HTTP/1.1 connection (h11, the gateway's own HTTP library) and
sends ``POST /v1/chat/completions`` with ``stream: true`` and ``stream_options.include_usage``, the
messages so far, and the request's drawn ``max_tokens``, ``temperature`` and ``seed`` (drawn through
``conversation.draw_request``, as the WebSocket and engine-only runs draw them). It measures what a
client sees: TTFT to the first chunk with text, inter-token latency per chunk, tokens from the final
``usage`` (each text chunk counts one token as it arrives; the remainder, such as an end-of-sequence token
without text, is added at the end). It drives any OpenAI-compatible server (tokenwire over HTTP,
llama.cpp's server, vLLM): ``--api-model`` names the model; tokenwire answers ``default``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import h11

from server.load.conversation import (
    RequestRecord,
    conversation_rng,
    draw_request,
    openai_cache_key,
    openai_headers,
    system_prompt,
)
from server.load.runner import ConversationRunner, RunState
from server.load.wire import Tally, chunked_overhead

SUBPROTOCOL = "sse"


class HttpError(Exception):
    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


def endpoint(url: str) -> tuple[str, int, str]:
    """(host, port, path of chat completions) from ``http://host:port[/v1]``."""
    u = urlsplit(url)
    if u.scheme != "http" or not u.hostname:
        raise ValueError(
            f"--api openai needs an http:// URL (the API's base, e.g. http://HOST:PORT/v1): {url}"
        )
    base = u.path.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    return u.hostname, u.port or 80, f"{base}/chat/completions"


class _Http:
    """One keep-alive connection; one request at a time."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.h11 = h11.Connection(h11.CLIENT)

    async def _open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.h11 = h11.Connection(h11.CLIENT)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.transport.abort()
        self.reader = self.writer = None

    async def post_stream(
        self, path: str, body: bytes, headers: list[tuple[str, str]]
    ) -> AsyncIterator[tuple[str, int] | bytes]:
        """Send a POST; yields ("status", code) and then the body's chunks as bytes."""
        if self.writer is None or self.h11.our_state is not h11.IDLE:
            self.close()
            await self._open()
        assert self.reader is not None and self.writer is not None
        hs = [("Host", f"{self.host}:{self.port}"), ("Content-Length", str(len(body))), *headers]
        out = self.h11.send(h11.Request(method="POST", target=path, headers=hs))
        out = (
            (out or b"")
            + (self.h11.send(h11.Data(data=body)) or b"")
            + (self.h11.send(h11.EndOfMessage()) or b"")
        )
        self.writer.write(out)
        await self.writer.drain()
        while True:
            ev = self.h11.next_event()
            if ev is h11.NEED_DATA:
                data = await self.reader.read(65536)
                self.h11.receive_data(data)
                continue
            if isinstance(ev, h11.Response):
                yield ("status", ev.status_code)
            elif isinstance(ev, h11.Data):
                yield bytes(ev.data)
            elif isinstance(ev, h11.EndOfMessage):
                if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
                    self.h11.start_next_cycle()
                else:
                    self.close()
                return
            elif isinstance(ev, h11.ConnectionClosed):
                self.close()
                raise HttpError("connection_closed")


def _events(buf: bytearray) -> list[bytes]:
    """Complete SSE events (their ``data:`` payloads) taken from the front of ``buf``."""
    out: list[bytes] = []
    while True:
        end = buf.find(b"\n\n")
        if end < 0:
            return out
        block = bytes(buf[:end])
        del buf[: end + 2]
        data = [ln[5:].strip() for ln in block.split(b"\n") if ln.startswith(b"data:")]
        if data:
            out.append(b"\n".join(data))


async def _request(st: RunState, conn: _Http, path: str, rec: RequestRecord, body: dict[str, Any]) -> str:
    """One streamed chat completion; fills ``rec``; returns the text."""
    cfg = st.cfg
    headers = [
        ("Content-Type", "application/json"),
        *openai_headers(cfg).items(),
        ("Idempotency-Key", rec.id),
    ]
    text: list[str] = []
    buf = bytearray()
    counted = 0
    last: float | None = None
    usage: dict[str, Any] | None = None
    measured = st.wire.measured.setdefault(SUBPROTOCOL, Tally())
    rec.sent_at = st.now()
    status = 0
    async for item in conn.post_stream(path, json.dumps(body).encode(), headers):
        if isinstance(item, tuple):
            status = item[1]
            continue
        if status != 200:
            continue
        buf += item
        for data in _events(buf):
            if data == b"[DONE]":
                continue
            obj = json.loads(data)
            if obj.get("error"):
                err = obj["error"]
                rec.error_code = (
                    str(err.get("code") or err.get("type") or "error") if isinstance(err, dict) else "error"
                )
                continue
            if obj.get("usage"):
                usage = obj["usage"]
            for choice in obj.get("choices") or ():
                delta = (choice.get("delta") or {}).get("content") or ""
                now = st.now()
                if delta:
                    if rec.first_at is None:
                        rec.first_at = now
                    elif last is not None:
                        rec.itl.append(now - last)
                    last = now
                    text.append(delta)
                    counted += 1
                    st.add_tokens(1, now)
                    size = len(data) + 8  # "data: " + "\n\n"
                    measured.add(size, chunked_overhead(size), 1)
                if choice.get("finish_reason"):
                    rec.finish_reason = choice["finish_reason"]
    rec.done_at = st.now()
    if status != 200:
        rec.error_code = f"http_{status}"
        return ""
    if usage is not None:
        total = int(usage.get("completion_tokens") or 0)
        rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        rec.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        if total > counted:
            st.add_tokens(total - counted, rec.done_at)
        rec.tokens = max(total, counted)
    else:
        rec.tokens = counted
    if rec.finish_reason is None and rec.error_code is None:
        rec.error_code = "no_finish"
    return "".join(text)


def openai_conversation(state: RunState) -> ConversationRunner:
    """Conversations over the OpenAI chat completions API at ``state.cfg.url``."""
    cfg = state.cfg
    host, port, path = endpoint(cfg.url)
    state.saw_server(f"{host}:{port}")

    async def run(user: int, conversation: int) -> None:
        rng = conversation_rng(cfg.seed, user, conversation)
        conn = _Http(host, port)
        system = system_prompt(cfg)
        history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        try:
            for turn in range(cfg.turns):
                if turn and cfg.think > 0:
                    await asyncio.sleep(rng.expovariate(1.0 / cfg.think))
                if not state.take_ticket():
                    return
                chat, rec = draw_request(cfg, rng, state.tag, user, conversation, turn, SUBPROTOCOL)
                rec.kill_at = None  # no drops over HTTP: a cut stream is resumed only by the Responses API
                assert chat.content is not None
                message = {"role": "user", "content": chat.content}
                body: dict[str, Any] = {
                    "model": cfg.api_model,
                    "messages": [*history, message],
                    "max_tokens": chat.params.max_tokens,
                    "temperature": chat.params.temperature,
                    "seed": chat.params.seed,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    **openai_cache_key(cfg, user, conversation),
                }
                if chat.params.cache is False:
                    body["cache"] = False  # tokenwire's extension (others ignore it): generate, never replay
                try:
                    text = await asyncio.wait_for(_request(state, conn, path, rec, body), cfg.request_timeout)
                except (OSError, HttpError, h11.ProtocolError, TimeoutError, ValueError) as exc:
                    rec.error_code = exc.code if isinstance(exc, HttpError) else type(exc).__name__
                    rec.done_at = state.now()
                    conn.close()
                    text = ""
                state.finish(rec)
                if not rec.ok:
                    return
                history += [message, {"role": "assistant", "content": text}]
        finally:
            conn.close()

    return run
