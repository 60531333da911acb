"""A loopback TCP proxy that can cut a connection from the server's side, for failure tests."""

from __future__ import annotations

import asyncio
import contextlib


class DropProxy:
    """Forwards 127.0.0.1:<port> to the target; ``drop(client_port)`` aborts the upstream socket of the
    connection whose client uses that local port, so the server sees the connection die first."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._upstreams: dict[int, asyncio.StreamWriter] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopped = False

    async def start(self, port: int = 0) -> int:
        """Listen on ``port`` (0: a free one; the previous port to come back after ``stop``)."""
        self._stopped = False
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        self._stopped = True  # a connection still opening its upstream is cut as soon as it has one
        if self._server is not None:
            self._server.close()
        for w in list(self._upstreams.values()):
            w.transport.abort()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def drop(self, client_port: int) -> bool:
        w = self._upstreams.get(client_port)
        if w is None:
            return False
        w.transport.abort()
        return True

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        client_port = cw.get_extra_info("peername")[1]
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            cw.transport.abort()
            return
        if self._stopped:
            cw.transport.abort()
            uw.transport.abort()
            return
        self._upstreams[client_port] = uw

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            # Either side gone: cut the other one abruptly too (no closing handshake).
            w.transport.abort()

        tasks = [asyncio.create_task(pipe(cr, uw)), asyncio.create_task(pipe(ur, cw))]
        self._tasks.update(tasks)
        try:
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self._tasks.difference_update(tasks)
            self._upstreams.pop(client_port, None)
            cw.transport.abort()
            uw.transport.abort()
