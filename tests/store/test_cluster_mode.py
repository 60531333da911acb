"""Cluster mode is detected from the URL alone (INFO cluster), and then the store uses redis-py's cluster
client and the partitioned keys; a plain Redis keeps one partition and the key names of before."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from server.app import ServeConfig, is_cluster, open_store
from server.store.keys import CLUSTER_PARTITIONS, Keys


async def test_a_cluster_node_is_detected_and_a_plain_one_is_not(redis_url: str, cluster_url: str) -> None:
    plain = aioredis.from_url(redis_url)
    node = aioredis.from_url(cluster_url)  # a plain client of one cluster node
    try:
        assert not await is_cluster(plain)
        assert await is_cluster(node)
    finally:
        await plain.aclose()
        await node.aclose()


async def test_open_store_on_a_cluster_uses_the_cluster_client_and_partitions(cluster_url: str) -> None:
    cfg = ServeConfig(redis_url=cluster_url, key_prefix="twtest-open:")
    async with open_store(cfg, embedded_ok=False) as h:
        assert isinstance(h.r, RedisCluster) and isinstance(h.reader, RedisCluster)
        assert h.store.keys.partitions == CLUSTER_PARTITIONS
        # The partitions spread over the masters: each of the 3 holds some of them.
        slots = {p: await h.r.cluster_keyslot(h.store.keys.queue(p)) for p in h.store.partitions}
        owners = {h.r.get_node_from_key(h.store.keys.queue(p)).name for p in slots}
        assert len(owners) == 3
        assert await h.store.queued() == 0


async def test_open_store_on_a_plain_redis_keeps_one_partition_and_the_old_names(redis_url: str) -> None:
    async with open_store(
        ServeConfig(redis_url=redis_url, key_prefix="twtest-plain:"), embedded_ok=False
    ) as h:
        assert h.store.keys.partitions == 1
        assert h.store.keys.request("alice", "r1") == "twtest-plain:req:5:alice:r1"
        assert h.store.keys.queue() == "twtest-plain:queue"


def test_every_key_of_an_owner_shares_its_partition_slot() -> None:
    from redis.crc import key_slot

    k = Keys("tw:", CLUSTER_PARTITIONS)
    p = k.partition("alice")
    same = {
        key_slot(x.encode())
        for x in (
            k.request("alice", "r"),
            k.log("alice", "r"),
            k.inflight("alice"),
            k.rate("chat", "alice"),
            k.history("s", "alice"),
            k.session("s", "alice"),
            k.cache("c", "alice"),
            k.queue(p),
            k.queued_count(p),
            k.worker_queue("w", p),
            k.worker_requests("w", p),
            k.wake("g", p),
        )
    }
    assert len(same) == 1
    assert k.partition_of(k.request("alice", "r")) == p
    assert k.log_of(k.request("alice", "r")) == k.log("alice", "r")
    assert key_slot(k.workers.encode()) == key_slot(k.workers_load.encode())
    assert len({key_slot(k.queue(q).encode()) for q in range(CLUSTER_PARTITIONS)}) == CLUSTER_PARTITIONS


def test_a_local_cluster_needs_its_password_and_leaves_nothing_behind() -> None:
    import redis as sync_redis

    from server.store.valkey_cluster import EmbeddedValkeyCluster

    cluster = EmbeddedValkeyCluster(2)
    url = cluster.start(timeout=60)
    try:
        procs = [n.proc for n in cluster.nodes]
        folders = [n.folder for n in cluster.nodes]
        rc = sync_redis.RedisCluster.from_url(url)
        assert len(rc.get_primaries()) == 2 and rc.cluster_info()["cluster_state"] == "ok"
        rc.close()
        stranger = sync_redis.Redis(host="127.0.0.1", port=cluster.nodes[0].port)
        with pytest.raises(sync_redis.AuthenticationError):
            stranger.ping()
        stranger.close()
    finally:
        cluster.stop()
    assert all(p is not None and p.poll() is not None for p in procs)  # the nodes have exited
    assert not any(f.exists() for f in folders)  # and their data folders are gone


def test_a_prefix_with_braces_is_refused_on_a_cluster() -> None:
    # A brace in the prefix would become every key's hash tag: all partitions on one slot.
    Keys("t{w}:", 1)  # harmless on a plain Redis
    with pytest.raises(ValueError, match="braces"):
        Keys("t{w}:", CLUSTER_PARTITIONS)
