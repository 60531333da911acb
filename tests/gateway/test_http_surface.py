"""The plain-HTTP surface of the client port (SPEC §2.3): GET only (405 otherwise, with Allow), 404 for
unknown paths, and `/metrics` never public once auth is on or it has a port of its own."""

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
        ("HEAD", "/healthz"),
    ],
)
async def test_other_methods_are_405_with_allow(server: Running, method: str, path: str) -> None:
    status, headers, _ = await _http(server.port, method, path)
    assert status == 405, (method, path, status)
    assert headers["allow"] == "GET"


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


async def test_a_request_with_a_body_is_refused_and_the_server_serves_on(server: Running) -> None:
    with pytest.raises((http.client.RemoteDisconnected, ConnectionResetError)):
        await _http(server.port, "POST", "/healthz", b'{"x": 1}')
    assert (await _http(server.port, "GET", "/healthz"))[0] == 200
