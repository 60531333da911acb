"""Writing to a client's WebSocket, for both WebSocket doors (/v1/ws and the Responses WebSocket).

Two ways a send can hold a connection long after its client is gone, and what this module does instead:

* **A client that stops reading** fills the socket buffers and blocks the send. Waiting for ever would pile
  its frames up in memory: after ``slow_reader_timeout_s`` the connection is aborted (its requests run on;
  the client can resume them).
* **A client that closed** (its close frame was read) while the door had frames to send: websockets' ``send``
  then waits for the TCP connection to end, up to its close timeout (websockets' default 10 s, CLOSE_TIMEOUT_S
  here). But the server reads only two frames ahead of the door (``max_queue=2``, server.py), so when the
  client sent a frame or two before its close, websockets has stopped reading and cannot see the end it waits
  for, while the door, their only reader, waits in ``send``. So :func:`send` fails at once on a socket that is
  not open, a door stops reading once its socket is closing (:func:`closing`: nobody is there to answer, and a
  read would wait for a TCP close only the client can send), and the door, once it stops, calls :func:`drain`:
  the frames left unread are dropped, websockets reads on, and the connection ends as soon as the client's
  does, or is aborted CLOSE_TIMEOUT_S later if the client never closes its end. Before, each such close held
  the connection, and the streams and grants of its requests, for 10 s (and for ever on the Responses
  WebSocket once it had sent its close and kept the TCP connection open).

A socket whose closing handshake started while its door was waiting for a frame never reaches
:func:`drain`: the keepalive sweep aborts it once its close deadline has passed (keepalive.py). That
deadline is CLOSE_TIMEOUT_S after the closing began too (server.py passes it to websockets as its close
timeout): with websockets' 10 s such a client was held 10 s and up to one sweep more.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.protocol import State

# How long a closing connection may take to end once its door stops reading: the client's close reply or
# TCP close takes a round trip (a phone's included) and is normally there at once, so this only bounds a
# client that closes, or is closed (connection.py's protocol close), and then never lets go.
CLOSE_TIMEOUT_S = 2.0


async def send(
    ws: ServerConnection,
    data: str | bytes,
    slow_reader_timeout_s: float,
    log: structlog.BoundLogger,
    door: str,
) -> None:
    """Send one frame. Raises ConnectionClosed at once when the socket is closing or closed, and after
    ``slow_reader_timeout_s`` when the client does not read (the connection is then aborted, and
    ``{door}.slow_reader_closed`` logged)."""
    if ws.state is not State.OPEN:
        # No codes: the doors only stop on it (and websockets asserts on some mixes of them).
        raise ConnectionClosed(None, None)
    try:
        # asyncio.timeout, not wait_for: wait_for runs the send as a task of its own, and when the send
        # fails that task's exception, whose traceback holds wait_for's frame, which holds the task, is a
        # reference cycle keeping the closed connection (and its last frames read) until a full collection.
        async with asyncio.timeout(slow_reader_timeout_s):
            await ws.send(data)
    except TimeoutError:
        log.warning(f"{door}.slow_reader_closed")
        ws.transport.abort()
        raise ConnectionClosed(None, None) from None


def closing(ws: ServerConnection) -> bool:
    """The closing handshake has started (or the connection is gone): a door stops reading."""
    return ws.state is not State.OPEN


async def drain(ws: ServerConnection) -> None:
    """Drop what the client sent and the door did not read, until the connection ends; abort it if it has
    not after CLOSE_TIMEOUT_S (websockets' own close deadline was fixed when the closing began). For
    a door that stopped reading, on a connection that is closing; nothing on one still open."""
    if ws.state is State.OPEN:
        return  # the door returned on its own: websockets closes it, with its full handshake
    with contextlib.suppress(ConnectionClosed, TimeoutError):
        async with asyncio.timeout(CLOSE_TIMEOUT_S):
            async for _ in ws:
                pass
    if ws.state is not State.CLOSED:
        ws.transport.abort()
