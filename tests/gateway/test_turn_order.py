"""Content-mode turns of one session are accepted one after another: a turn sent before the previous one
ended waits for it, so each turn sees the one before it (SPEC.md, content mode). Before, both read the
same history and the earlier turn was left out of the later one's conversation."""

from __future__ import annotations

import asyncio

import pytest

from protocol import Accepted, Cancel, Chat, Delta, Done, Params, Ping, Pong
from server.client import Client
from server.gateway.connection import Connection
from tests.gateway.conftest import Running


async def test_turns_sent_at_once_are_taken_in_order(server: Running) -> None:
    server.engine.step_s = 0.02  # the first turn is still running when the others arrive
    c = await Client.connect(server.url)
    params = Params(max_tokens=6, seed=3)
    for i, word in enumerate(("one", "two", "three")):
        await c.send(Chat(id=f"t{i}", content=word, params=params))
    await c.send(Ping(ts=7))  # not held up by the waiting turns
    order: list[str] = []
    texts: dict[str, str] = {"t0": "", "t1": "", "t2": ""}
    pong_before_t1 = None
    done = 0
    while done < 3:
        f = await c.recv()
        if isinstance(f, Pong):
            pong_before_t1 = "accepted:t1" not in order
        elif isinstance(f, Accepted | Done):
            order.append(f"{type(f).__name__.lower()}:{f.id}")
            done += isinstance(f, Done)
        elif isinstance(f, Delta):
            texts[f.id] += f.text
    await c.close()
    assert order == ["accepted:t0", "done:t0", "accepted:t1", "done:t1", "accepted:t2", "done:t2"]
    assert pong_before_t1 is True
    # The fake reply opens with the number of messages the engine saw: 1, then 3, then 5.
    assert texts["t0"].startswith("re[1] one")
    assert texts["t1"].startswith("re[3] two")
    assert texts["t2"].startswith("re[5] three")


async def test_turns_of_one_session_on_two_connections_each_see_the_previous(server: Running) -> None:
    server.engine.step_s = 0.02
    a = await Client.connect(server.url)
    assert a.welcome is not None
    b = await Client.connect(server.url, session_token=a.welcome.session_token)
    params = Params(max_tokens=6, seed=3)
    await a.send(Chat(id="x", content="first", params=params))
    await b.send(Chat(id="y", content="second", params=params))
    texts: dict[str, str] = {}
    for client, rid in ((a, "x"), (b, "y")):
        text = ""
        async for f in client.frames_for(rid):
            if isinstance(f, Delta):
                text += f.text
        texts[rid] = text
    await a.close()
    await b.close()
    # Whichever was accepted second saw the first one's turn.
    assert sorted(t.split(" ")[0] for t in texts.values()) == ["re[1]", "re[3]"]


async def test_a_turn_overtaken_after_admission_waits_off_the_read_loop(
    server: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Admission found no unfinished turn in the session, but by submit time another connection's turn
    was running (the race, forced here by hiding that turn from admission's look, as if it read the
    session just before the other turn was accepted). The submit (which reuses that look) then finds
    the session's turn moved, and the turn must wait like any other, answered ``waiting`` at once, and
    the connection's read loop must go on: before, it polled for the other turn inline, and a ping went
    unanswered for that turn's whole reply."""
    server.engine.step_s = 0.05
    server.engine.reply_len = 1000
    a = await Client.connect(server.url)
    assert a.welcome is not None
    b = await Client.connect(server.url, session_token=a.welcome.session_token)
    await a.send(Chat(id="long", content="a long story", params=Params(max_tokens=200)))
    async for f in a.frames_for("long"):
        if isinstance(f, Delta):
            break  # running, and far from done (200 tokens at 20 a second)

    real = Connection._previous_turn
    hidden = {"n": 0}

    async def overtaken(self: Connection, id: str) -> tuple[str, bool]:
        prev, pending = await real(self, id)
        if id == "late" and hidden["n"] == 0:
            hidden["n"] += 1
            return "", False  # admission's look: the session had no turn yet
        return prev, pending

    monkeypatch.setattr(Connection, "_previous_turn", overtaken)
    await b.send(Chat(id="late", content="and then?", params=Params(max_tokens=4)))
    await b.send(Ping(ts=9))
    seen: list[str] = []
    async with asyncio.timeout(5):  # the long turn has ~9 s to go
        while "pong" not in seen:
            f = await b.recv()
            seen.append("pong" if isinstance(f, Pong) else f"{f.type}:{getattr(f, 'id', '')}")
    assert seen == ["waiting:late", "pong"]
    assert server.gateway.core.admission.waiting_by_session  # it holds a waiting slot
    await a.send(Cancel(id="long"))
    kinds = [f.type async for f in b.frames_for("late")]
    assert kinds[0] == "accepted" and kinds[-1] == "done"
    assert not server.gateway.core.admission.waiting_by_session
    await a.close()
    await b.close()


async def test_a_cancel_of_a_waiting_turn_drops_it_and_answers_done_cancelled(server: Running) -> None:
    # Stop pressed on a turn the server still holds (SPEC §4.2): before, the cancel got not_found (nothing
    # existed yet) and the turn ran anyway once the previous one ended.
    c, _ = await _two_turns_waiting(server)
    async with asyncio.timeout(10):
        await c.send(Cancel(id="a"))
        while True:
            f = await c.recv()
            if isinstance(f, Done) and f.id == "a":
                break
    assert (f.finish_reason, f.offset, f.usage.completion_tokens) == ("cancelled", 0, 0)
    # The running turn streams on, unharmed; b follows it, not the dropped one.
    await c.send(Cancel(id="t1"))
    ends = {}
    async with asyncio.timeout(10):
        while "b" not in ends:
            f = await c.recv()
            if isinstance(f, Done):
                ends[f.id] = f.finish_reason
            assert not (isinstance(f, Accepted) and f.id == "a")
    assert ends == {"t1": "cancelled", "b": "length"}
    assert server.engine.requests_started == 2
    assert c.welcome is not None
    assert await server.store.get(f"anon:{c.welcome.session}", "a") is None  # never created
    assert not server.gateway.core.admission.waiting_by_session  # its waiting slot is given back
    await c.close()


async def _two_turns_waiting(server: Running) -> tuple[Client, list[str]]:
    """A connection with turn t1 running long, a waiting behind it and b behind a; the frames seen."""
    server.engine.reply_len = 400
    server.engine.step_s = 0.02
    c = await Client.connect(server.url)
    await c.send(Chat(id="t1", content="a long one", params=Params(max_tokens=300)))
    await c.send(Chat(id="a", content="first queued", params=Params(max_tokens=3)))
    await c.send(Chat(id="b", content="second queued", params=Params(max_tokens=3)))
    seen: list[str] = []
    async with asyncio.timeout(10):
        while "waiting:b" not in seen:
            f = await c.recv()
            seen.append(f"{f.type}:{getattr(f, 'id', '')}")
    return c, seen


async def test_turns_after_a_dropped_one_keep_the_order_they_were_sent_in(server: Running) -> None:
    # t1 running, a and b waiting; b is cancelled, then d is sent. d must still follow a, though b (the
    # turn d was sent after) ended at once.
    c, order = await _two_turns_waiting(server)
    async with asyncio.timeout(10):
        await c.send(Cancel(id="b"))
        while "done:b" not in order:
            f = await c.recv()
            order.append(f"{f.type}:{getattr(f, 'id', '')}")
        await c.send(Chat(id="d", content="third queued", params=Params(max_tokens=3)))
        await c.send(Cancel(id="t1"))
        while "done:d" not in order:
            f = await c.recv()
            if not isinstance(f, Delta):
                order.append(f"{f.type}:{getattr(f, 'id', '')}")
    accepted = [x for x in order if x.startswith("accepted:")]
    assert accepted == ["accepted:t1", "accepted:a", "accepted:d"], order
    await c.close()


async def test_closing_with_turns_waiting_gives_back_every_stream(server: Running) -> None:
    # A turn waiting behind another turn of its connection when the connection closes held a stream of
    # its owner; it must be given back (it used to stay counted until the gateway restarted).
    c, _ = await _two_turns_waiting(server)
    admission = server.gateway.core.admission
    assert sum(admission.streams_by_owner.values()) == 3
    await c.close()
    async with asyncio.timeout(10):
        for _ in range(500):  # the close's tasks give their grants back as they end
            if not sum(admission.streams_by_owner.values()) and not admission.waiting_by_session:
                break
            await asyncio.sleep(0.02)
    assert not sum(admission.streams_by_owner.values()) and not admission.waiting_by_session


async def test_a_waiting_turn_sent_again_is_the_same_turn(server: Running) -> None:
    # A client unsure its chat arrived sends it again (SPEC §10.2) while the server holds it waiting: the
    # same turn, answered waiting again, with no second waiting slot or stream, and one done on its cancel.
    # Before, the copy waited as a second turn: it took the session's last waiting slot, and a cancel
    # answered two done frames.
    c, _ = await _two_turns_waiting(server)
    admission = server.gateway.core.admission
    assert c.welcome is not None
    slots = dict(admission.waiting_by_session), sum(admission.streams_by_owner.values())
    assert slots == ({c.welcome.session: 2}, 3)  # a and b wait, at the session's limit of 2
    frames: list[str] = []
    async with asyncio.timeout(10):
        await c.send(Chat(id="a", content="first queued", params=Params(max_tokens=3)))
        await c.send(Chat(id="a", content="another text", params=Params(max_tokens=3)))
        await c.send(Ping(ts=1))
        while "pong:" not in frames:
            f = await c.recv()
            frames.append(f"{f.type}:{getattr(f, 'after', None) or getattr(f, 'code', '')}")
        assert frames == ["waiting:t1", "error:idempotency_conflict", "pong:"]
        assert (dict(admission.waiting_by_session), sum(admission.streams_by_owner.values())) == slots
        await c.send(Cancel(id="a"))
        await c.send(Cancel(id="t1"))
        ends: list[str] = []
        while "b" not in ends:
            f = await c.recv()
            if isinstance(f, Done):
                ends.append(f.id)
    assert ends == ["a", "t1", "b"]  # one done for a
    assert server.engine.requests_started == 2  # t1 and b
    await c.close()


async def test_a_turn_sent_again_as_its_wait_ends_is_not_answered_waiting_after_its_accepted(
    server: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The resend's admission reads the store (the owner's rate), and the turn's wait can end meanwhile.
    # It was then answered waiting after its own accepted; now, accepted and still streaming, it is
    # re-attached from 0 as any chat of an attached id is (SPEC §8.9).
    server.engine.reply_len = 400
    server.engine.step_s = 0.02
    c = await Client.connect(server.url)
    await c.send(Chat(id="t1", content="a long one", params=Params(max_tokens=300)))
    await c.send(Chat(id="a", content="queued", params=Params(max_tokens=200)))  # 4 s once it runs
    admission = server.gateway.core.admission
    real = admission.store.rate
    slow = {"once": True}

    async def rate(*args: object, **kw: object) -> int:
        if slow["once"]:
            slow["once"] = False
            await asyncio.sleep(1.0)  # t1's cancel takes effect, and a is accepted, meanwhile
        return await real(*args, **kw)  # type: ignore[arg-type]

    frames: list[str] = []
    async with asyncio.timeout(15):
        while "waiting:a" not in frames:
            f = await c.recv()
            frames.append(f"{f.type}:{getattr(f, 'id', '')}")
        monkeypatch.setattr(admission.store, "rate", rate)
        await c.send(Cancel(id="t1"))
        await c.send(Chat(id="a", content="queued", params=Params(max_tokens=200)))
        while "done:a" not in frames:
            f = await c.recv()
            if not isinstance(f, Delta):
                frames.append(f"{f.type}:{getattr(f, 'id', '')}")
    assert [x for x in frames if x.endswith(":a")] == ["waiting:a", "accepted:a", "accepted:a", "done:a"], (
        frames
    )
    await c.close()
