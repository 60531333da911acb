"""The plain-HTTP surface of the client port (SPEC §2.3): GET and HEAD only (405 otherwise, with Allow), 404
for unknown paths, 400 / 505 for what is not HTTP/1.1, and `/metrics` never public once auth is on or it
has a port of its own."""

from __future__ import annotations

import asyncio
import http.client

import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from server.gateway.server import GatewaySettings
from server.store.keys import Keys
from tests.gateway.conftest import Running, running_server


def _request(
    port: int, method: str, path: str, body: bytes | None = None
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


async def _http(
    port: int, method: str, path: str, body: bytes | None = None
) -> tuple[int, dict[str, str], bytes]:
    return await asyncio.get_running_loop().run_in_executor(None, _request, port, method, path, body)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/"),
        ("DELETE", "/metrics"),
        ("PUT", "/healthz"),
        ("POST", "/readyz"),
        ("POST", "/v1/ws"),
        ("PATCH", "/ui/index.html"),
        ("OPTIONS", "/healthz"),
    ],
)
async def test_other_methods_are_405_with_allow(server: Running, method: str, path: str) -> None:
    status, headers, _ = await _http(server.port, method, path)
    assert status == 405, (method, path, status)
    assert headers["allow"] == "GET, HEAD"


# Not /metrics: its counters move between the two requests, and its length with them.
@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/", "/index.html", "/config.json"])
async def test_head_is_get_without_the_body(server: Running, path: str) -> None:
    # RFC 9110 §9.3.2. Before, HEAD was 405 here, and on an API path the server wrote the 405's body
    # after h11 had framed a HEAD response, failed with a traceback, and dropped the connection.
    get_status, get_headers, body = await _http(server.port, "GET", path)
    status, headers, empty = await _http(server.port, "HEAD", path)
    assert (status, empty) == (get_status, b"")
    assert headers["content-length"] == get_headers["content-length"] == str(len(body))


async def _exchange(port: int, raw: bytes) -> bytes:
    """Send raw bytes, read until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        async with asyncio.timeout(10):
            return await reader.read()
    finally:
        writer.close()


async def test_head_on_an_api_path_is_405_without_a_body_and_the_connection_serves_on(
    server: Running,
) -> None:
    answer = await _exchange(
        server.port,
        b"HEAD /v1/models/x HTTP/1.1\r\nHost: x\r\n\r\n"
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    first, _, rest = answer.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 405 Method Not Allowed\r\n") and b"\r\nAllow: GET\r\n" in first
    assert rest.startswith(b"HTTP/1.1 200 OK\r\n"), answer  # no body between them


@pytest.mark.parametrize(
    ("request_line", "status"),
    [
        (b"GET  /healthz  HTTP/1.1", b"400"),  # double spaces
        (b"GET /v1/models?a= b HTTP/1.1", b"400"),  # a space in the target
        (b"GET /healthz", b"400"),  # HTTP/0.9
        (b"GET /healthz HTTP/2.0", b"505"),
        (b"GET /v1/models HTTP/3.1", b"505"),
        (b"\r\nGET /healthz HTTP/1.1", b"200"),  # an empty line first is ignored (RFC 9112 §2.2)
        (b"GET /healthz HTTP/1.0", b"200"),
    ],
)
async def test_a_request_line_is_answered_whatever_it_holds(
    server: Running, request_line: bytes, status: bytes
) -> None:
    # Before, websockets took every line that was not an API path's, and closed without a word on one it
    # could not parse.
    answer = await _exchange(server.port, request_line + b"\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 " + status), answer[:200]


async def test_pipelined_plain_requests_get_the_first_answered_then_a_close(server: Running) -> None:
    answer = await _exchange(
        server.port,
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /readyz HTTP/1.1\r\nHost: x\r\n\r\n",
    )
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b"\r\n\r\nok\n"), answer


async def test_ws_path_without_an_upgrade_is_426(server: Running) -> None:
    status, headers, body = await _http(server.port, "GET", "/v1/ws")
    assert (status, headers["upgrade"]) == (426, "websocket"), body


@pytest.mark.parametrize(
    "path",
    [
        "/nope",
        "/v1/wsx",
        "/v1/ws/",
        "/v1",
        "/metricsx",
        "/healthz/x",
        "/ui/nope.js",
        "/ui/",
        "/src",
        "/%2e%2e/",
    ],
)
async def test_unknown_paths_are_404_for_any_method(server: Running, path: str) -> None:
    for method in ("GET", "POST", "DELETE"):
        status, _, _ = await _http(server.port, method, path)
        assert status == 404, (method, path, status)


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics", "/", "/index.html", "/healthz?probe=1"])
async def test_documented_get_paths_answer_200(server: Running, path: str) -> None:
    status, _, _ = await _http(server.port, "GET", path)
    assert status == 200, (path, status)


async def test_metrics_are_not_public_when_auth_is_on(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    gw = GatewaySettings(port=0, auth_secret="a-secret-of-at-least-thirty-two-bytes")
    async with running_server(redis, redis_url, keys, gateway=gw) as server:
        status, _, body = await _http(server.port, "GET", "/metrics")
        assert status == 404 and b"tokenwire_" not in body
        assert (await _http(server.port, "GET", "/healthz"))[0] == 200


@pytest.mark.parametrize("auth", [None, "a-secret-of-at-least-thirty-two-bytes"], ids=["auth_off", "auth_on"])
async def test_metrics_port_serves_metrics_and_the_client_port_does_not(
    redis: aioredis.Redis, redis_url: str, keys: Keys, auth: str | None
) -> None:
    gw = GatewaySettings(port=0, metrics_port=0, auth_secret=auth)
    async with running_server(redis, redis_url, keys, gateway=gw) as server:
        assert server.gateway.metrics_server is not None
        mport = server.gateway.metrics_server.port
        assert mport != server.port
        status, headers, body = await _http(mport, "GET", "/metrics")
        assert status == 200 and headers["content-type"].startswith("text/plain")
        names = {f.name for f in text_string_to_metric_families(body.decode())}
        assert "tokenwire_connections_open" in names
        assert (await _http(server.port, "GET", "/metrics"))[0] == 404
        assert (await _http(mport, "GET", "/healthz"))[0] == 404
        assert (await _http(mport, "POST", "/metrics"))[0] == 405


async def test_a_request_with_a_body_is_answered_and_the_server_serves_on(server: Running) -> None:
    status, headers, _ = await _http(server.port, "POST", "/healthz", b'{"x": 1}')
    assert (status, headers["connection"]) == (405, "close")
    assert (await _http(server.port, "GET", "/healthz"))[0] == 200
