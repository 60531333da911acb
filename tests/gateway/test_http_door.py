"""The HTTP door's own defences (issue 24): a deadline for a whole request, an idle timeout between
requests, caps on connections per gateway and per peer, Idempotency-Keys that round-trip in a path, and
no leaked subscription or attach count when a stream fails as it starts."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import time
from typing import Any

import redis.asyncio as aioredis

from server.gateway.server import GatewaySettings
from server.store.keys import Keys
from tests.gateway.conftest import Running, running_server
from tests.gateway.test_http_surface import _exchange, _http


async def _open(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def _status_line(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    return await asyncio.wait_for(reader.readline(), timeout_s)


async def test_a_trickled_body_gets_408_at_the_request_deadline(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    gw = GatewaySettings(port=0, http_request_timeout_s=1.5, http_idle_timeout_s=10)
    async with running_server(redis, redis_url, keys, gateway=gw) as server:
        reader, writer = await _open(server.port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n"
        )
        started = time.monotonic()
        answer = b""

        async def trickle() -> None:
            # One byte every 0.2 s: each arrives well within any per-read timeout, so before this the
            # connection was held for as long as the client kept dripping.
            for _ in range(100):
                writer.write(b" ")
                await writer.drain()
                await asyncio.sleep(0.2)

        task = asyncio.create_task(trickle())
        try:
            answer = await _status_line(reader, 6.0)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        took = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert took < 5.0
        writer.close()


async def test_trickled_headers_get_408_too(redis: aioredis.Redis, redis_url: str, keys: Keys) -> None:
    gw = GatewaySettings(port=0, http_request_timeout_s=1.0)
    async with running_server(redis, redis_url, keys, gateway=gw) as server:
        reader, writer = await _open(server.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")

        async def trickle() -> None:
            for i in range(60):
                writer.write(f"X-Drip-{i}: y\r\n".encode())
                await writer.drain()
                await asyncio.sleep(0.1)

        task = asyncio.create_task(trickle())
        try:
            answer = await _status_line(reader, 5.0)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        writer.close()


async def test_an_idle_keep_alive_connection_is_closed(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    gw = GatewaySettings(port=0, http_idle_timeout_s=0.5, http_request_timeout_s=30)
    async with running_server(redis, redis_url, keys, gateway=gw) as server:
        reader, writer = await _open(server.port)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _status_line(reader, 5.0)).startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        rest = await asyncio.wait_for(reader.read(), 5.0)  # the body, then EOF once it was idle
        assert rest.endswith(b"}")
        assert time.monotonic() - started < 4.0
        writer.close()


async def test_connections_past_the_peer_cap_get_429_and_past_the_gateway_cap_503(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    gw = GatewaySettings(port=0, max_http_connections=3, max_http_connections_per_peer=2)
    async with running_server(redis, redis_url, keys, gateway=gw) as server:
        held = []
        for _ in range(2):
            r, w = await _open(server.port)
            w.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await _status_line(r, 5.0)).startswith(b"HTTP/1.1 200")
            held.append((r, w))
        r3, w3 = await _open(server.port)
        w3.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await asyncio.wait_for(r3.read(), 5.0)
        assert answer.startswith(b"HTTP/1.1 429") and b"Retry-After" in answer
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["message"] and error["code"] == "rate_limited"  # SPEC §15.6
        w3.close()
        api = server.gateway.http
        api.caps.max_per_peer = 10
        api.caps.max_total = 2  # as if other peers held the rest
        r4, w4 = await _open(server.port)
        w4.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await asyncio.wait_for(r4.read(), 5.0)
        assert answer.startswith(b"HTTP/1.1 503")
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "overloaded"
        w4.close()
        # Health probes and the UI are answered however full the caps: a gateway whose HTTP API
        # connections are at the cap must not fail its liveness probe (and get restarted, dropping every
        # WebSocket). Not counted in the caps, nor by the churn collector (a full collection a minute).
        await asyncio.sleep(0.2)  # the refused connections above are closed, and counted, by now
        closed = server.gateway.collector.closed
        for path in ("/healthz", "/readyz", "/"):
            status, _, _ = await _http(server.port, "GET", path)
            assert status == 200, path
        assert (api.caps.total, server.gateway.collector.closed) == (2, closed)
        for _, w in held:
            w.close()
        await asyncio.sleep(0.2)
        assert api.caps.total == 0 and api.caps.by_peer == {}  # closed connections are given back


def _post(server: Running, path: str, body: dict[str, Any], key: str | None = None) -> Any:
    async def go() -> tuple[int, Any]:
        def call() -> tuple[int, bytes]:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            try:
                headers = {"Content-Type": "application/json"}
                if key is not None:
                    headers["Idempotency-Key"] = key
                conn.request("POST", path, body=json.dumps(body).encode(), headers=headers)
                r = conn.getresponse()
                return r.status, r.read()
            finally:
                conn.close()

        status, raw = await asyncio.get_running_loop().run_in_executor(None, call)
        return status, json.loads(raw)

    return go()


async def test_a_request_framed_both_ways_is_refused_and_its_connection_closed(server: Running) -> None:
    # Content-Length and Transfer-Encoding both: how long the body is depends on who reads it (a proxy
    # in front may take the length, h11 takes the chunks), the shape of request smuggling. RFC 9112 §6.1.
    reader, writer = await _open(server.port)
    body = b'{"model":"default","input":"hi"}'
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    writer.write(
        b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        + f"{len(body):x}\r\n".encode()
        + body
        + b"\r\n0\r\n\r\n"
        + smuggled
    )
    await writer.drain()
    rest = await asyncio.wait_for(reader.read(), 10)  # to the close: nothing after the 400
    writer.close()
    assert rest.startswith(b"HTTP/1.1 400 ") and b"Content-Length and Transfer-Encoding" in rest
    assert rest.count(b"HTTP/1.1 ") == 1  # the bytes behind it were never read as a request
    # Two of a header whose one value decides whose request it is, or which: refused alike.
    for twice in (
        b"Authorization: Bearer a\r\nAuthorization: Bearer b",
        b"Idempotency-Key: a\r\nidempotency-key: b",
    ):
        reader, writer = await _open(server.port)
        writer.write(
            b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + twice
            + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        rest = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert rest.startswith(b"HTTP/1.1 400 ") and b"more than one" in rest, rest[:200]


async def test_idempotency_keys_that_cannot_round_trip_in_a_path_are_refused(server: Running) -> None:
    body = {"model": "default", "input": "hi", "background": True, "max_output_tokens": 2}
    for key in ("a/b", "a?b", "a#b", "a%2Fb", "a b"):
        status, err = await _post(server, "/v1/responses", body, key)
        assert status == 400 and err["error"]["param"] == "Idempotency-Key", key
    # Every accepted key can be retrieved and cancelled by its response id, quoted or not.
    status, made = await _post(server, "/v1/responses", body, "order:42@shop+x")
    assert status == 200 and made["id"] == "resp_order:42@shop+x"
    for path in ("/v1/responses/resp_order:42@shop+x", "/v1/responses/resp_order%3A42%40shop%2Bx"):
        got, _, raw = await _http(server.port, "GET", path)
        assert got == 200 and json.loads(raw)["id"] == made["id"], path
    status, cancelled = await _post(server, "/v1/responses/resp_order%3A42%40shop%2Bx/cancel", {})
    assert status == 200 and cancelled["id"] == made["id"]


async def test_a_stream_whose_touch_fails_leaks_no_subscription_or_attach(server: Running) -> None:
    core = server.gateway.core
    touch = core.store.touch
    calls = 0

    async def failing_touch(keys: list[str]) -> int:
        nonlocal calls
        calls += 1
        raise ConnectionError("the store went away for a moment")

    core.store.touch = failing_touch  # type: ignore[method-assign]
    try:
        body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        # The stream fails after its headers went out: the server ends the connection mid-body.
        with contextlib.suppress(http.client.IncompleteRead):
            await _http(server.port, "POST", "/v1/chat/completions", json.dumps(body).encode())
    finally:
        core.store.touch = touch  # type: ignore[method-assign]
    assert calls >= 1
    await asyncio.sleep(0.1)
    # Before, the subscription and the attach count were taken outside the try: both stayed forever,
    # and the request counted as attached so its detach timeout never ran.
    assert core.streams.attached == {}
    assert core.admission.streams_by_owner == {}
    assert all(not subs for p in core.streams.reader._parts for subs in p._subs.values())


async def test_bytes_pipelined_behind_a_streamed_response_are_read_one_request_ahead_at_most(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    """While a response streams, what the client sends next waits in h11's buffer for the next cycle.
    Before, reading went on regardless, so a client could pile up any number of bytes there behind one
    slow stream (paced, but never bounded). Now reading pauses one request's worth ahead."""
    async with running_server(redis, redis_url, keys) as server:
        server.engine.step_s = 0.05  # the stream lasts ~10 s
        server.engine.reply_len = 200
        body = json.dumps(
            {
                "model": "default",
                "stream": True,
                "max_tokens": 200,
                "messages": [{"role": "user", "content": "hi"}],
            }
        ).encode()
        reader, writer = await _open(server.port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert (await _status_line(reader, 5.0)).startswith(b"HTTP/1.1 200")
        junk = b"x" * (1 << 20)
        for _ in range(8):  # 8 MiB behind it; the client's transport buffers what the server won't read
            writer.write(junk)
        await asyncio.sleep(3.0)  # at the paced 2 MiB/s the old code had read 6 MiB or more by now
        (conn,) = list(server.gateway.http.connections)
        buffered = len(conn.h11.trailing_data[0])
        cap = conn.max_body + 64 * 1024
        assert buffered <= cap + (1 << 20), f"{buffered} bytes buffered behind the stream (cap {cap})"
        writer.close()


def _error_of(response: bytes) -> dict[str, Any]:
    body = json.loads(response.split(b"\r\n\r\n", 1)[1])
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return dict(body["error"])


async def test_the_http_layers_own_errors_have_a_code_and_plain_words(server: Running) -> None:
    # SPEC §15.1 / §15.6: a head over 16 KiB is 431 even when it arrives whole in one read (h11 bounds
    # only a head still arriving), on the API and on a plain path alike.
    for path in (b"/v1/models", b"/healthz"):
        big = b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 17_000 + b"\r\n\r\n"
        rest = await _exchange(server.port, big)
        assert rest.startswith(b"HTTP/1.1 431 "), rest[:100]
        assert _error_of(rest)["code"] == "headers_too_large"
        many = (
            b"GET "
            + path
            + b" HTTP/1.1\r\nHost: x\r\n"
            + b"".join(b"X-%d: aaaa\r\n" % i for i in range(2000))
        )
        rest = await _exchange(server.port, many + b"\r\n")
        assert rest.startswith(b"HTTP/1.1 431 "), rest[:100]
    # Just under the bound is served.
    near = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-A: " + b"a" * 15_000 + b"\r\n\r\n"
    assert (await _exchange(server.port, near)).startswith(b"HTTP/1.1 200 ")
    # A parser error says what is wrong in words, not in Python reprs of the bytes, and has a code.
    chunk = (
        b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n-5\r\nhello\r\n0\r\n\r\n"
    )
    rest = await _exchange(server.port, chunk)
    assert rest.startswith(b"HTTP/1.1 400 "), rest[:100]
    err = _error_of(rest)
    assert err["code"] == "invalid_request_error" and "b'" not in err["message"], err
    gzip = (
        b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: gzip\r\n\r\n"
    )
    rest = await _exchange(server.port, gzip)
    assert rest.startswith(b"HTTP/1.1 501 ") and _error_of(rest)["code"] == "unsupported_transfer_coding"
    assert server.engine.requests_started == 0


async def test_a_body_is_utf8_and_a_bearer_token_at_most_4096_characters(server: Running) -> None:
    text = '{"model":"default","messages":[{"role":"user","content":"hi"}],"max_tokens":2}'
    for body in (text.encode("utf-16"), b"\xef\xbb\xbf" + text.encode(), text.encode("utf-32")):
        req = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/json; charset=utf-16\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        rest = await _exchange(server.port, req)
        assert rest.startswith(b"HTTP/1.1 400 "), (body[:4], rest[:200])
        assert _error_of(rest)["code"] == "invalid_request_error"
    # The same body in UTF-8 is served: the charset parameter is not what decides.
    req = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Type: application/json; charset=latin-1\r\n"
        + f"Content-Length: {len(text)}\r\n\r\n".encode()
        + text.encode()
    )
    assert (await _exchange(server.port, req)).startswith(b"HTTP/1.1 200 ")
    # As hello.token's bound (SPEC §15.2): a longer bearer token is refused with auth off too.
    for n, status in ((4096, b"200"), (4097, b"401")):
        req = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer " + b"k" * n
        rest = await _exchange(server.port, req + b"\r\n\r\n")
        assert rest.startswith(b"HTTP/1.1 " + status + b" "), (n, rest[:200])
    assert _error_of(rest)["code"] == "invalid_api_key"
