"""OpenAI's Responses WebSocket mode with the official SDK, and tokenwire's lossless reconnect.

The SDK reconnects by itself after a recoverable close (1001, 1006, 1011, 1012, 1013) when it is given
an ``on_reconnecting`` handler, and the handler may change the next handshake's query. tokenwire reads
``tw_resume=RESPONSE_ID:SEQUENCE_NUMBER[,…]`` there and continues each named response after that event
(SPEC.md §15.7): the reply goes on with nothing repeated and nothing missing, on whichever gateway the
new socket reaches. Run it against ``tokenwire serve``: ``python -m server.examples.openai_ws_resume``.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from openai import AsyncOpenAI
from openai.types.websocket_reconnection import ReconnectingEvent, ReconnectingOverrides

END = ("response.completed", "response.incomplete", "response.failed")


class ResumeTracker:
    """What the client is reading: per lane (``stream_id``, None for the default lane), the response and
    the last ``sequence_number`` seen. Feed it every event; give its :meth:`on_reconnecting` to
    ``client.responses.connect``."""

    def __init__(self) -> None:
        self.reading: dict[str | None, tuple[str, int]] = {}

    def see(self, event: Any) -> None:
        lane = getattr(event, "stream_id", None)
        seq = getattr(event, "sequence_number", None)
        if event.type == "response.created":
            self.reading[lane] = (event.response.id, event.sequence_number)
        elif lane in self.reading and isinstance(seq, int) and event.type != "error":
            self.reading[lane] = (self.reading[lane][0], seq)
        if event.type in END:
            self.reading.pop(lane, None)

    def on_reconnecting(self, event: ReconnectingEvent) -> ReconnectingOverrides:
        query = {k: v for k, v in dict(event.extra_query).items() if k != "tw_resume"}
        if self.reading:
            query["tw_resume"] = ",".join(f"{rid}:{seq}" for rid, seq in self.reading.values())
        return {"extra_query": query}


async def main(base_url: str = "http://127.0.0.1:8765/v1", prompt: str = "Tell me a short story.") -> str:
    client = AsyncOpenAI(base_url=base_url, api_key="any")  # with --auth-secret: a JWT
    tracker = ResumeTracker()
    text = []
    try:
        async with client.responses.connect(on_reconnecting=tracker.on_reconnecting) as conn:
            await conn.response.create(model="default", input=prompt)
            async for event in conn:
                tracker.see(event)
                if event.type == "response.output_text.delta":
                    text.append(event.delta)
                    print(event.delta, end="", flush=True)
                elif event.type in END or event.type == "error":
                    break
    finally:
        await client.close()
    print()
    return "".join(text)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
