"""``tokenwire load --api openai-ws URL``: the same seeded workload over OpenAI's Responses WebSocket mode.

Each conversation holds one WebSocket on ``/v1/responses`` (SPEC §15.7: what the official SDKs'
``client.responses.connect()`` opens, JSON text frames, ``Authorization: Bearer`` in the handshake) and
sends one ``response.create`` per turn, drawn through ``conversation.draw_request`` as the other runs
draw theirs: the turn's user message as ``input``, the drawn ``max_output_tokens`` and ``temperature``,
and from the second turn on ``previous_response_id`` (the server continues the stored conversation, so
only the new input travels, as a client of this mode does). The Responses API has no ``seed`` (the server
draws one per request) and no cache opt-out: at ``--temperature 0`` a repeated run may be answered from
the response cache. It measures what a client sees, as ``--api openai`` does: TTFT to the first
``response.output_text.delta``, inter-token latency per delta, tokens from the final response's
``usage`` (each delta counts one token as it arrives; the remainder is added at the end), and the bytes
of each delta event with its WebSocket frame header.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import urlsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import WebSocketException

from server.load.connection import ws_header_bytes
from server.load.conversation import (
    RequestRecord,
    conversation_rng,
    draw_request,
    openai_cache_key,
    openai_headers,
    system_prompt,
)
from server.load.runner import ConversationRunner, RunState
from server.load.wire import Tally

SUBPROTOCOL = "openai-ws"
END = ("response.completed", "response.incomplete", "response.failed")
_SCHEMES = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}


class ResponseError(Exception):
    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


def endpoint(url: str) -> str:
    """The ``ws://HOST:PORT/v1/responses`` URL from the API's base, ``http://HOST:PORT[/v1]`` (as for
    ``--api openai`` and the SDK's ``base_url``) or its ``ws://`` form."""
    u = urlsplit(url)
    if u.scheme not in _SCHEMES or not u.hostname:
        raise ValueError(
            f"--api openai-ws needs the API's base URL (e.g. http://HOST:PORT/v1 or ws://HOST:PORT/v1): {url}"
        )
    base = u.path.rstrip("/").removesuffix("/responses")
    if not base.endswith("/v1"):
        base += "/v1"
    return f"{_SCHEMES[u.scheme]}://{u.netloc}{base}/responses"


def _finish(response: dict[str, Any]) -> tuple[str | None, str | None]:
    """(finish_reason, error_code) of a final response object, in the report's terms."""
    status = response.get("status")
    if status == "completed":
        return "stop", None
    if status == "incomplete":
        reason = (response.get("incomplete_details") or {}).get("reason")
        return ("length" if reason == "max_output_tokens" else str(reason or "incomplete")), None
    err = response.get("error") or {}
    return None, str(err.get("code") or status or "failed")


async def _request(st: RunState, ws: ClientConnection, rec: RequestRecord, body: dict[str, Any]) -> str:
    """One streamed response; fills ``rec``; returns the response's id."""
    measured = st.wire.measured.setdefault(SUBPROTOCOL, Tally())
    counted = 0
    last: float | None = None
    await ws.send(json.dumps({"type": "response.create", **body}))
    rec.sent_at = st.now()
    while True:
        data = await ws.recv()
        size = len(data) if isinstance(data, bytes) else len(data.encode())
        ev = json.loads(data)
        kind = ev.get("type")
        if kind == "response.output_text.delta":
            if not ev.get("delta"):
                continue
            now = st.now()
            if rec.first_at is None:
                rec.first_at = now
            elif last is not None:
                rec.itl.append(now - last)
            last = now
            counted += 1
            st.add_tokens(1, now)
            measured.add(size, ws_header_bytes(size), 1)
        elif kind == "error":  # the create was refused (admission, a field): no response follows
            err = ev.get("error") or {}
            raise ResponseError(str(err.get("code") or err.get("type") or "error"))
        elif kind in END:
            response = ev.get("response") or {}
            break
    rec.done_at = st.now()
    rec.finish_reason, rec.error_code = _finish(response)
    usage = response.get("usage") or {}
    total = int(usage.get("output_tokens") or 0)
    rec.prompt_tokens = int(usage.get("input_tokens") or 0)
    rec.cached_tokens = int((usage.get("input_tokens_details") or {}).get("cached_tokens") or 0)
    if total > counted:
        st.add_tokens(total - counted, rec.done_at)
    rec.tokens = max(total, counted)
    return str(response.get("id") or "")


def openai_ws_conversation(state: RunState) -> ConversationRunner:
    """Conversations over the Responses WebSocket mode at ``state.cfg.url``'s ``/v1/responses``."""
    cfg = state.cfg
    url = endpoint(cfg.url)
    state.saw_server(urlsplit(url).netloc)
    headers = openai_headers(cfg)

    async def run(user: int, conversation: int) -> None:
        rng = conversation_rng(cfg.seed, user, conversation)
        ws: ClientConnection | None = None
        previous: str | None = None
        system = system_prompt(cfg)
        try:
            for turn in range(cfg.turns):
                if turn and cfg.think > 0:
                    await asyncio.sleep(rng.expovariate(1.0 / cfg.think))
                if not state.take_ticket():
                    return
                chat, rec = draw_request(cfg, rng, state.tag, user, conversation, turn, SUBPROTOCOL)
                rec.kill_at = None  # no planned drops here (a reconnect would resume with tw_resume)
                assert chat.content is not None
                body: dict[str, Any] = {
                    "model": cfg.api_model,
                    "input": [{"role": "user", "content": chat.content}],
                    "max_output_tokens": chat.params.max_tokens,
                    "temperature": chat.params.temperature,
                    **openai_cache_key(cfg, user, conversation),
                }
                if system:  # instructions are not carried over from the previous response: every turn
                    body["instructions"] = system
                if previous is not None:
                    body["previous_response_id"] = previous
                try:
                    async with asyncio.timeout(cfg.request_timeout):
                        if ws is None:
                            ws = await connect(
                                url,
                                additional_headers=headers,
                                max_size=None,
                                ping_interval=None,
                                compression=None,
                            )
                        previous = await _request(state, ws, rec, body)
                except (OSError, WebSocketException, ResponseError, TimeoutError, ValueError) as exc:
                    rec.error_code = exc.code if isinstance(exc, ResponseError) else type(exc).__name__
                    rec.done_at = state.now()
                state.finish(rec)
                if not rec.ok:
                    return
        finally:
            if ws is not None:
                ws.transport.abort()

    return run
