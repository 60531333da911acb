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


async def test_a_rate_counter_without_an_expiry_gets_one_when_it_refuses(redis, keys) -> None:  # type: ignore[no-untyped-def]
    """rate.lua sets the expiry on a window's first count only; a counter found over the limit with none
    (written some other way) must not refuse that owner for ever."""
    from server.store.requests import RequestStore

    s = RequestStore(redis, keys)
    await redis.set(keys.rate("chat", "w"), 10)  # no expiry
    wait = await s.rate("w", "chat", 3, window_ms=60_000)
    assert 0 < wait <= 60_000
    assert 0 < await redis.pttl(keys.rate("chat", "w")) <= 60_000


# The gateway's layers (issue 24): a core the doors use, doors that depend only on the core, and
# server.py assembling them. A module may import only from its own layer or the ones below it, and the
# import graph (TYPE_CHECKING imports included) has no cycle.
LAYERS: dict[str, int] = {
    # the core: settings, identity, models, admission, submit, attached streams
    "settings": 0,
    "auth": 0,
    "routing": 0,
    "models": 0,
    "static": 0,
    "ui_config": 0,
    "ingress": 0,
    "egress": 0,
    "admission": 1,
    "degradation": 1,
    "streams": 2,
    "submit": 2,
    "core": 3,
    # every WebSocket's connection class and its keepalive sweep
    "keepalive": 0,
    # what the HTTP doors share (framing, errors, the endpoints' handle on the core)
    "front_door": 4,
    "http_conn": 4,
    "http_common": 5,
    # what the two Responses doors share (objects, events, sequence numbers; reading a create body)
    "responses_events": 5,
    "responses_request": 6,
    # the doors, one file each (http_api routes the HTTP API's endpoints)
    "connection": 7,
    "openai_chat": 7,
    "openai_responses": 7,
    "openai_responses_ws": 7,
    "http_api": 8,
    # the assembly
    "server": 9,
}
DOORS = {"connection", "openai_chat", "openai_responses", "openai_responses_ws"}


def _gateway_imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in sorted(Path(server.gateway.__file__).parent.glob("*.py")):
        if path.stem == "__init__":
            continue
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("server.gateway."):
                deps.add(node.module.split(".")[2])
            elif isinstance(node, ast.ImportFrom) and node.module == "server.gateway":
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name.split(".")[2] for a in node.names if a.name.startswith("server.gateway."))
        graph[path.stem] = deps
    return graph


def test_every_gateway_module_has_a_layer() -> None:
    assert sorted(_gateway_imports()) == sorted(LAYERS)


def test_nothing_in_the_gateway_imports_upward_or_sideways_between_doors() -> None:
    graph = _gateway_imports()
    upward = [f"{m} -> {d}" for m, deps in graph.items() for d in deps if LAYERS[d] > LAYERS[m]]
    assert upward == []
    between_doors = [f"{m} -> {d}" for m, deps in graph.items() if m in DOORS for d in deps if d in DOORS]
    assert between_doors == []
    assert [m for m, deps in graph.items() if "server" in deps] == []


def test_the_gateway_import_graph_has_no_cycle() -> None:
    graph = _gateway_imports()
    state: dict[str, int] = {}
    cycles: list[str] = []

    def visit(m: str, path: list[str]) -> None:
        if state.get(m) == 1:
            cycles.append(" -> ".join([*path[path.index(m) :], m]))
            return
        if state.get(m) == 2:
            return
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            visit(d, [*path, m])
        state[m] = 2

    for m in sorted(graph):
        visit(m, [])
    assert cycles == []


def test_only_the_core_touches_what_admission_guards() -> None:
    """A door that called the store's submit, the log reader's subscribe or the rate counters itself
    would skip the admission step: only their owners in the core may."""
    owners = {"submit": {"submit"}, "subscribe": {"streams"}, "rate": {"admission"}}
    found: dict[str, set[str]] = {k: set() for k in owners}
    for path in sorted(Path(server.gateway.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in owners
                and isinstance(node.value, ast.Attribute)
                and node.value.attr in ("store", "reader")
            ):
                found[node.attr].add(path.stem)
    assert found == owners
