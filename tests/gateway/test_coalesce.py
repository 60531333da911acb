"""``hello.coalesce_ms`` (issue 27): a client on a phone's radio asks for at most one delta per stream every
N ms; offsets stay exact, so the text and every resume point are what they would be without it."""

from __future__ import annotations

import asyncio
import itertools

from protocol import Accepted, Cancel, Chat, Delta, Done, Error, Hello, Message, Params, Resume, Welcome
from server.client import Client, collect
from tests.gateway.conftest import Running

TOKENS = 60


async def _run(server: Running, coalesce_ms: int | None, id: str) -> tuple[str, list[Delta], Done, str]:
    c = await Client.connect(server.url, hello=False)
    await c.send(Hello(coalesce_ms=coalesce_ms))
    welcome = await c.recv()
    assert isinstance(welcome, Welcome)
    await c.send(Chat(id=id, content="count", params=Params(max_tokens=TOKENS, seed=5)))
    deltas: list[Delta] = []
    done = None
    async for f in c.frames_for(id):
        if isinstance(f, Delta):
            deltas.append(f)
        elif isinstance(f, Done):
            done = f
    await c.close()
    assert done is not None
    return "".join(d.text for d in deltas), deltas, done, welcome.session_token


async def test_coalesced_deltas_are_fewer_and_exact(server: Running) -> None:
    server.engine.step_s = 0.01  # 100 tokens a second: ~10 per 100 ms window
    server.engine.reply_len = 400
    plain_text, plain, plain_done, _ = await _run(server, None, "plain")
    text, deltas, done, _ = await _run(server, 100, "coalesced")
    assert done.offset == plain_done.offset == TOKENS
    # The same seed and prompt: the same completion, whatever the framing.
    assert text.split(" ", 1)[1] == plain_text.split(" ", 1)[1]
    offsets = [d.offset for d in deltas]
    assert offsets[0] == 0 and all(a.offset + a.n == b.offset for a, b in itertools.pairwise(deltas))
    assert deltas[-1].offset + deltas[-1].n == done.offset
    assert len(plain) >= TOKENS // 2  # without it, about one frame per step
    assert len(deltas) <= TOKENS // 5, [d.n for d in deltas]


async def test_a_resume_lands_on_a_coalesced_boundary(server: Running) -> None:
    server.engine.step_s = 0.01
    server.engine.reply_len = 400
    _, deltas, done, token = await _run(server, 100, "r")
    c = await Client.connect(server.url, hello=False)
    await c.send(Hello(session_token=token, coalesce_ms=100))
    await c.recv()
    mid = deltas[len(deltas) // 2]
    await c.send(Resume(id="r", offset=mid.offset))
    got = [f async for f in c.frames_for("r")]
    await c.close()
    assert isinstance(got[0], Accepted)
    replay = [f for f in got if isinstance(f, Delta)]
    assert replay[0].offset == mid.offset and "".join(d.text for d in replay) == "".join(
        d.text for d in deltas[len(deltas) // 2 :]
    )
    assert isinstance(got[-1], Done) and got[-1].offset == done.offset


async def test_coalesce_ms_out_of_range_is_a_bad_hello(server: Running) -> None:
    for bad in (1001, -1, 2.5, "100"):
        c = await Client.connect(server.url, hello=False)
        await c.send_raw({"type": "hello", "v": 1, "coalesce_ms": bad})
        f = await c.recv()
        assert isinstance(f, Error) and f.code == "bad_frame" and "coalesce_ms" in f.message, bad
        await c.close()


async def test_the_end_is_not_held_for_the_window(server: Running) -> None:
    """A stream's end (its last tokens, a cancel) goes out when the log ends, not when the window it
    arrived in closes: the window is stretched here to 30 s, and the reply still ends at once, whole."""
    server.engine.step_s = 0.005
    server.engine.reply_len = 400
    c = await Client.connect(server.url, hello=False)
    await c.send(Hello(coalesce_ms=1000))
    assert isinstance(await c.recv(), Welcome)
    for conn in server.gateway.connections:
        conn.coalesce_s = 30.0  # what a test cannot wait out: only the end can cut it short
    t0 = asyncio.get_running_loop().time()
    await c.send(Chat(id="e", content="count", params=Params(max_tokens=TOKENS)))
    await c.send(Chat(id="x", messages=(Message(role="user", content="hi"),), params=Params(max_tokens=400)))
    got = [f async for f in c.frames_for("e")]
    deltas = [f for f in got if isinstance(f, Delta)]
    assert isinstance(got[-1], Done) and got[-1].offset == TOKENS == sum(d.n for d in deltas)
    await c.send(Cancel(id="x"))
    _, _, cancelled, _ = await collect(c.frames_for("x"))
    assert cancelled is not None and cancelled.finish_reason == "cancelled"
    assert asyncio.get_running_loop().time() - t0 < 20  # a held window would be 30 s (and 60 for both)
    await c.close()
