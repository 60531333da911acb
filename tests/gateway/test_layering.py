"""The gateway reaches Redis only through the store (DESIGN.md §2): no gateway module imports redis."""

from __future__ import annotations

import ast
from pathlib import Path

import server.gateway


def test_gateway_modules_do_not_import_redis() -> None:
    offenders = []
    for path in sorted(Path(server.gateway.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "redis"]
    assert offenders == []


async def test_user_rate_is_counted_across_gateways_in_the_store(redis, keys) -> None:  # type: ignore[no-untyped-def]
    from server.store.requests import RequestStore

    a, b = RequestStore(redis, keys), RequestStore(redis, keys)  # two gateways on one Redis
    assert [await s.rate("u", "chat", 3, window_ms=60_000) for s in (a, b, a)] == [0, 0, 0]
    wait = await b.rate("u", "chat", 3, window_ms=60_000)
    assert 0 < wait <= 60_000
    assert await a.rate("u", "resume", 3, window_ms=60_000) == 0  # another kind, another counter
    assert await a.rate("v", "chat", 3, window_ms=60_000) == 0  # another owner too
    assert 0 < await redis.pttl(keys.rate("chat", "u")) <= 60_000  # it expires with its window
