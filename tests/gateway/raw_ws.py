"""A raw WebSocket client for the gateway's tests: a plain socket that frames by hand, so that it answers
nothing (a Ping control frame, a full buffer) unless the test does."""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import struct

import msgpack

PING, PONG, CLOSE, BINARY = 0x9, 0xA, 0x8, 0x2


class RawClient:
    """A WebSocket client on a plain socket: it sends only what it is told (no Pong of its own)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, port: int, path: str = "/v1/ws", sock: socket.socket | None = None) -> RawClient:
        """Handshake on ``path`` (the protocol's subprotocol on /v1/ws); ``sock``: a socket already
        connected to the port, for a test that sets its options."""
        if sock is None:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        else:
            reader, writer = await asyncio.open_connection(sock=sock)
        key = base64.b64encode(os.urandom(16)).decode()
        subprotocol = "Sec-WebSocket-Protocol: tokenwire.v1.msgpack\r\n" if path == "/v1/ws" else ""
        writer.write(
            (
                f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                f"{subprotocol}\r\n"
            ).encode()
        )
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 101"), head
        return cls(reader, writer)

    def send(self, opcode: int, payload: bytes) -> None:
        assert len(payload) < 126
        mask = os.urandom(4)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.writer.write(bytes([0x80 | opcode, 0x80 | len(payload)]) + mask + masked)

    def send_frame(self, frame: dict[str, object]) -> None:
        self.send(BINARY, msgpack.packb(frame))

    async def recv(self) -> tuple[int, bytes]:
        b0, b1 = await self.reader.readexactly(2)
        n = b1 & 0x7F
        if n == 126:
            (n,) = struct.unpack("!H", await self.reader.readexactly(2))
        elif n == 127:
            (n,) = struct.unpack("!Q", await self.reader.readexactly(8))
        return b0 & 0x0F, await self.reader.readexactly(n)
