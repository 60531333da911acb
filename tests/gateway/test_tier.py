"""The JWT ``tier`` claim becomes the user's fair-share weight, and reaches the engine with the owner."""

from __future__ import annotations

import time

import jwt
import pytest
import redis.asyncio as aioredis
from openai import AsyncOpenAI

from protocol import Params, ProtocolError
from server.client import Client, collect
from server.engine.api import GenerationRequest, StepOutput
from server.gateway.auth import authenticate, authenticate_user, tier_weight
from server.gateway.server import GatewaySettings
from server.store.keys import Keys
from tests.fakes import FakeEngine
from tests.gateway.conftest import running_server

SECRET = "jwt-test-secret-of-at-least-32-bytes!"


def token(sub: str, **claims: object) -> str:
    return jwt.encode({"sub": sub, "exp": int(time.time() + 60), **claims}, SECRET, algorithm="HS256")


@pytest.mark.parametrize(
    ("tier", "weight"),
    [
        ("free", 1.0),
        ("PRO", 4.0),
        ("plus", 2.0),
        ("enterprise", 8.0),
        (3, 3.0),
        (0.5, 0.5),
        (0, 1.0),
        (1e9, 1.0),
        (float("nan"), 1.0),
        (True, 1.0),
        ("gold-ish", 1.0),
        (["pro"], 1.0),
        (None, 1.0),
    ],
)
def test_tier_maps_to_a_bounded_weight(tier: object, weight: float) -> None:
    assert tier_weight(tier) == weight


def test_authenticate_user_reads_the_tier_and_still_requires_sub() -> None:
    assert authenticate_user(token("ann", tier="pro"), SECRET) == ("ann", 4.0)
    assert authenticate_user(token("bob"), SECRET) == ("bob", 1.0)
    assert authenticate(token("ann", tier="pro"), SECRET) == "ann"
    assert authenticate_user(None, None) == (None, 1.0)  # auth off: anonymous, weight 1
    with pytest.raises(ProtocolError):
        authenticate_user(jwt.encode({"exp": int(time.time() + 60)}, SECRET, algorithm="HS256"), SECRET)
    # A NUL could spell a keyless caller's prompt_cache_key scope (engine Seq.scope): refused.
    with pytest.raises(ProtocolError, match="without NUL"):
        authenticate_user(token("http:anonymous\0k"), SECRET)
    # A lone surrogate (a JSON escape can spell one) is not text: no store key could hold it.
    for sub in ("\ud800", "ab\udfff"):
        with pytest.raises(ProtocolError, match="Unicode string"):
            authenticate_user(token(sub), SECRET)
    # RFC 7519's NumericDate is a number: PyJWT alone would take "exp": "<digits>" (and a bool's int).
    later = int(time.time() + 60)
    for claims in (
        {"exp": str(later)},
        {"exp": later, "nbf": "0"},
        {"exp": True},
        {"exp": later, "iat": [1]},
    ):
        with pytest.raises(ProtocolError) as ei:  # the last two: PyJWT's own refusals (expired, not an int)
            authenticate_user(jwt.encode({"sub": "ann", **claims}, SECRET, algorithm="HS256"), SECRET)
        assert ei.value.code == "unauthorized"
        if isinstance(claims.get("exp"), str) or "nbf" in claims:
            assert "must be a number" in ei.value.message
    assert authenticate_user(token("ann", nbf=0, iat=float(later - 120)), SECRET) == ("ann", 1.0)


class RecordingEngine(FakeEngine):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[GenerationRequest] = []

    def _intake(self, req: GenerationRequest, outs: list[StepOutput]) -> None:
        self.seen.append(req)
        super()._intake(req, outs)


async def test_the_owner_and_the_tier_weight_reach_the_engine(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    engine = RecordingEngine()
    async with running_server(
        redis, redis_url, keys, engine=engine, gateway=GatewaySettings(port=0, auth_secret=SECRET)
    ) as server:
        for sub, claims in (("ann", {"tier": "pro"}), ("bob", {})):
            c = await Client.connect(server.url, token=token(sub, **claims))
            _, _, done, errors = await collect(c.chat("hi", id=f"{sub}-1", params=Params(max_tokens=3)))
            assert done is not None and not errors
            await c.close()
        # An OpenAI call's prompt_cache_key reaches the engine with its request (ann's, tier and all).
        sdk = AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1", api_key=token("ann", tier="pro"), max_retries=0
        )
        await sdk.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            prompt_cache_key="conv-9",
        )
        await sdk.close()
    assert [(r.user, r.weight, r.cache_key) for r in engine.seen] == [
        ("ann", 4.0, ""),
        ("bob", 1.0, ""),
        ("ann", 4.0, "conv-9"),
    ]
