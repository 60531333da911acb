"""Auth on (SPEC §11, §15.2, §15.7), as an outside probe found it wanting: a JWT whose sub spells an
auth-off owner's name, issuers' clocks and audiences, and a Responses WebSocket handshake with two
Authorization headers."""

from __future__ import annotations

import asyncio
import json
import time

import jwt
import pytest
import redis.asyncio as aioredis
import websockets

from protocol import Accepted, Error, ErrorCode, Resume
from protocol.frames import ProtocolError
from server.client import Client, collect
from server.gateway.auth import authenticate_user, user_of
from server.gateway.server import GatewaySettings
from server.store.keys import Keys
from tests.gateway.conftest import running_server

SECRET = "jwt-test-secret-of-at-least-32-bytes!"


def token(sub: str, **claims: object) -> str:
    return jwt.encode({"sub": sub, "exp": int(time.time() + 60), **claims}, SECRET, algorithm="HS256")


def test_a_sub_that_spells_an_auth_off_owner_is_a_user_of_its_own() -> None:
    for sub in ("anon:abc", "http:anonymous", "http:" + "0" * 32, "jwt:anon:abc", "jwt:x"):
        assert authenticate_user(token(sub), SECRET) == ("jwt:" + sub, 1.0)
    # Every other sub is the user as it is (the store's keys of existing users do not change).
    for sub in ("alice", "https://idp.example/u/1", "Anon:x", "anon", "user:jwt:x"):
        assert authenticate_user(token(sub), SECRET) == (sub, 1.0)
    # One-to-one: no two subs name one user, and no user is an auth-off owner's name.
    subs = ["anon:x", "jwt:anon:x", "jwt:jwt:anon:x", "x", "jwt:x", "http:anonymous", "jwt:http:anonymous"]
    users = [user_of(s) for s in subs]
    assert len(set(users)) == len(users)
    assert not any(u.startswith(("anon:", "http:")) for u in users)


def test_clock_skew_and_an_audience_are_not_refusals() -> None:
    now = int(time.time())
    # An issuer whose clock runs ahead: iat and nbf a little in the future (SPEC §11: 60 s of leeway).
    assert authenticate_user(token("ann", iat=now + 5, nbf=now + 5), SECRET) == ("ann", 1.0)
    # Just expired by a clock that runs behind.
    assert authenticate_user(token("ann", exp=now - 5), SECRET) == ("ann", 1.0)
    # Many issuers add an audience; the secret is the deployment's own, so it is not checked.
    assert authenticate_user(token("ann", aud="tokenwire"), SECRET) == ("ann", 1.0)
    assert authenticate_user(token("ann", aud=["a", "b"], iss="idp"), SECRET) == ("ann", 1.0)
    # Past the leeway, both ways.
    for claims in ({"exp": now - 120}, {"nbf": now + 120}, {"iat": now + 120}):
        with pytest.raises(ProtocolError) as ei:
            authenticate_user(token("ann", **claims), SECRET)
        assert ei.value.code == ErrorCode.UNAUTHORIZED


async def test_a_jwt_cannot_reach_the_requests_of_an_auth_off_gateway_sharing_the_store(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    """An operator turning auth on, or a cluster with gateways of both kinds, over one store: the owners
    of the auth-off gateway are "anon:<session>" and "http:..." names, which a JWT's sub could spell."""
    async with (
        running_server(redis, redis_url, keys) as off,
        running_server(redis, redis_url, keys, gateway=GatewaySettings(port=0, auth_secret=SECRET)) as on,
    ):
        anon = await Client.connect(off.url)
        assert anon.welcome is not None
        _, _, done, errors = await collect(anon.chat("secret", id="anon-secret"))
        assert done is not None and not errors
        body = {"model": "default", "input": "secret", "max_output_tokens": 3}
        reader, writer = await asyncio.open_connection("127.0.0.1", off.port)
        data = json.dumps(body).encode()
        writer.write(
            b"POST /v1/responses HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n"
            + f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        rid = json.loads((await asyncio.wait_for(reader.read(), 10)).split(b"\r\n\r\n", 1)[1])["id"]
        writer.close()

        # The auth-off session's owner is anon:<session>; a JWT naming it is another user.
        thief = await Client.connect(on.url, token=token(f"anon:{anon.welcome.session}"))
        await thief.send(Resume(id="anon-secret", offset=0))
        answer = await asyncio.wait_for(thief.recv(), 10)
        assert isinstance(answer, Error) and answer.code == ErrorCode.NOT_FOUND, answer
        # Its session token is bound to the auth-off owner: not this user's.
        with pytest.raises(Exception, match="session_token: not valid for this user"):
            await Client.connect(
                on.url,
                token=token(f"anon:{anon.welcome.session}"),
                session_token=anon.welcome.session_token,
            )
        # Keyless HTTP callers of the auth-off gateway share the owner "http:anonymous".
        reader, writer = await asyncio.open_connection("127.0.0.1", on.port)
        writer.write(
            f"GET /v1/responses/{rid} HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n"
            f"Authorization: Bearer {token('http:anonymous')}\r\n\r\n".encode()
        )
        status = (await asyncio.wait_for(reader.read(), 10)).split(b" ", 2)[1]
        writer.close()
        assert status == b"404"
        # The same user, with an ordinary sub, on the auth-on gateway: its own requests as before.
        alice = await Client.connect(on.url, token=token("alice"))
        _, _, done, errors = await collect(alice.chat("mine", id="anon-secret"))  # same id, its own
        assert done is not None and not errors
        await alice.send(Resume(id="anon-secret", offset=0))
        assert isinstance(await asyncio.wait_for(alice.recv(), 10), Accepted)
        for c in (anon, thief, alice):
            await c.close()


async def test_a_responses_websocket_handshake_with_two_authorization_headers_is_400(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    # SPEC §15.1 and §15.7: was a 500 (the handshake's header lookup raised on the second value).
    async with running_server(
        redis, redis_url, keys, gateway=GatewaySettings(port=0, auth_secret=SECRET)
    ) as s:
        good = f"Bearer {token('alice')}"
        for headers in (
            [("Authorization", good), ("Authorization", good)],
            [("Authorization", good), ("authorization", "x")],
        ):
            with pytest.raises(websockets.exceptions.InvalidStatus) as err:
                async with websockets.connect(
                    f"ws://127.0.0.1:{s.port}/v1/responses", additional_headers=headers
                ):
                    pass
            assert err.value.response.status_code == 400
            assert b"more than one Authorization header" in err.value.response.body
        async with websockets.connect(
            f"ws://127.0.0.1:{s.port}/v1/responses", additional_headers=[("Authorization", good)]
        ) as ws:
            await ws.send(json.dumps({"type": "response.create", "model": "default", "input": "hi"}))
            assert json.loads(await asyncio.wait_for(ws.recv(), 10))["type"] == "response.created"
