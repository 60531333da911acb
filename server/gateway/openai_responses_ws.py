"""OpenAI's Responses API in WebSocket mode: ``GET /v1/responses`` upgraded, on the same port.

What the official SDKs' ``client.responses.connect()`` speaks: JSON text frames, ``response.create``
client events whose body is the HTTP create body (read by responses_request.py, so both doors accept and
refuse the same fields) without ``stream`` and ``background``, and the same server events as the SSE
stream (built by responses_events.py, with the same sequence numbers). A response here is an ordinary
request of the store, submitted and followed through the core with one admission per
``response.create``, so it survives a dropped socket exactly as a WebSocket chat does.

* **Lanes.** One response at a time per lane: a ``response.create`` while one streams on its lane is
  answered ``response_already_in_flight``. The default lane is the connection; OpenAI's ``stream_id``
  (an optional field of ``response.create``, echoed in every event) names further lanes, so several
  responses can be multiplexed on one socket.
* **Warm-up.** ``generate: false`` creates a response with no output that a later
  ``previous_response_id`` continues from. Nothing is generated, so nothing is stored: it is known to
  this connection only (as OpenAI keeps warm-up state connection-local).
* **Lossless reconnect** (tokenwire's extension, SPEC.md §15.7): the handshake's query
  ``tw_resume=resp_a:17,resp_b:3`` names responses and the last ``sequence_number`` the client saw of
  each; each continues after that number on its lane, nothing repeated or missing, on any gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from typing import Any
from urllib.parse import parse_qs, urlsplit

import structlog
from websockets.asyncio.server import ServerConnection as WebSocket
from websockets.exceptions import ConnectionClosed

from protocol.codec import json_error
from server.gateway import egress
from server.gateway.admission import Grant, task_holding
from server.gateway.http_common import ApiError, Caller, HttpCore, bad, loads, optional_bool
from server.gateway.ingress import pace, peer_address
from server.gateway.responses_events import (
    PREFIX,
    NotABoundary,
    ResponseEvents,
    parse_seq,
    response_object,
    resume_point,
)
from server.gateway.responses_request import find_response, plan_create
from server.store.requests import FINAL_STATES

log = structlog.get_logger(__name__)

RESUME_PARAM = "tw_resume"
MAX_LANE_CHARS = 64
MAX_WARM = 64  # warm-ups kept per connection (the oldest is forgotten first)

Lane = str | None


class ResponsesSocket:
    """One WebSocket on ``/v1/responses``: its lanes, its warm-ups, and the events it writes."""

    def __init__(self, api: HttpCore, ws: WebSocket, caller: Caller) -> None:
        self.api = api
        self.core = api.core
        self.ws = ws
        self.caller = caller
        self.limits = self.core.admission.connection(peer_address(ws))
        self.lanes: dict[Lane, asyncio.Task[None]] = {}
        self.warm: dict[str, list[dict[str, str]]] = {}  # warm-up id -> its conversation
        self.log = log.bind(server=self.core.name, owner=caller.owner)

    async def run(self) -> None:
        try:
            await self._resume(self.ws.request.path if self.ws.request is not None else "")
            async for message in self.ws:
                # Reading is paced as on /v1/ws: a flood waits here and TCP pushes back on the sender.
                if not await pace(self.ws, self.limits.ingress, len(message)):
                    break
                await self._event(message)
                self.limits.ingress.done()
                if egress.closing(self.ws):
                    break  # the client closed: what it sent before is not served (egress.py)
        except ConnectionClosed:
            pass
        finally:
            # A dropped socket never cancels a response: it runs on (the detach timeout applies) and a
            # reconnect with tw_resume continues it. Only this socket's streams end.
            tasks = list(self.lanes.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.lanes.clear()
            self.limits.close()
            await egress.drain(self.ws)  # what the client sent before it closed, left unread

    async def _event(self, message: str | bytes) -> None:
        lane: Lane = None
        try:
            if isinstance(message, bytes):  # SPEC §15.7: events are JSON text frames, as OpenAI's are
                raise bad("a binary frame: send each event as a JSON text frame")
            try:
                body = loads(message)
            except (ValueError, RecursionError) as exc:
                raise bad(f"the event is not valid JSON: {json_error(exc)}"[:200]) from None
            if not isinstance(body, dict):
                raise bad("an event must be a JSON object with a type")
            lane = _lane(body.get("stream_id"))
            kind = body.get("type")
            if kind != "response.create":
                raise bad(f"type: {str(kind)[:60]!r} is not supported here; send response.create", "type")
            await self._create(body, lane)
        except ApiError as exc:
            await self._error(exc, lane)
        except ConnectionClosed:
            raise
        except Exception as exc:  # a bug or a store outage must not end the connection
            self.log.error("responses_ws.event_failed", exc_info=exc)
            await self._error(ApiError(500, f"internal error: {type(exc).__name__}", code="internal"), lane)

    async def _create(self, event: dict[str, Any], lane: Lane) -> None:
        body = {k: v for k, v in event.items() if k not in ("type", "stream_id", "generate", "stream")}
        generate = optional_bool(event, "generate") is not False  # absent or null: generate
        # stream and background are typed as over HTTP before their WebSocket meaning is checked.
        if optional_bool(event, "stream") is False:
            raise bad("stream: a WebSocket response is always streamed (leave stream out)", param="stream")
        if optional_bool(event, "background"):
            raise bad("background: not supported over WebSocket (use POST /v1/responses)", "background")
        body.pop("background", None)
        self._check_lane_free(lane)
        id = secrets.token_hex(12)
        try:
            plan = await plan_create(self.api, self.caller, body, id, local=self.warm, conn=self.limits)
        except ApiError as exc:
            if exc.code == "not_found":  # the only lookup a create makes
                raise ApiError(
                    400, exc.message, code="previous_response_not_found", param="previous_response_id"
                ) from None
            raise
        rid = PREFIX + id
        # The one admission step, before anything is held; a warm-up holds no stream.
        grant = await self.api.admit(self.caller, id, chat=plan.chat, conn=self.limits, stream=generate)
        if not generate:
            grant.release()
            self.warm[rid] = plan.conversation
            while len(self.warm) > MAX_WARM:
                self.warm.pop(next(iter(self.warm)))
            await self._warm_up(rid, plan.extra, plan.chat.params.model or "", lane)
            return
        try:
            extra = {**plan.extra, "stream_id": lane} if lane is not None else plan.extra
            await self.api.submit(
                self.caller, plan.chat, grant, kind="responses", extra=extra, cache_key=plan.cache_key
            )
        except BaseException:
            grant.release()
            raise
        self._start(lane, rid, grant, None)

    def _check_lane_free(self, lane: Lane) -> None:
        busy = self.lanes.get(lane)
        if busy is not None and not busy.done():
            where = f"stream_id {lane!r}" if lane is not None else "this connection"
            raise ApiError(
                409,
                f"a response is already in flight on {where}; wait for its end, or use another stream_id",
                code="response_already_in_flight",
            )

    async def _warm_up(self, rid: str, extra: dict[str, Any], model: str, lane: Lane) -> None:
        """``generate: false``: the response exists (to be continued from) and has no output."""
        payload = {**extra, "model": model}
        tail = {"stream_id": lane} if lane is not None else {}
        created = response_object(rid, payload, "in_progress", "", message=False)
        done = response_object(rid, payload, "completed", "", message=False)
        await self._send({"type": "response.created", "sequence_number": 0, "response": created, **tail})
        await self._send({"type": "response.completed", "sequence_number": 1, "response": done, **tail})

    def _start(self, lane: Lane, rid: str, grant: Grant, after: int | None) -> None:
        task = task_holding(grant, self._stream(lane, rid, grant, after), name=f"responses-ws-{rid}")
        self.lanes[lane] = task
        # A finished lane leaves the dict: its stream_id is the client's choice, so a long-lived socket
        # creating response after response on new lanes would otherwise grow it without bound.
        task.add_done_callback(lambda t: self._lane_done(lane, t))

    def _lane_done(self, lane: Lane, task: asyncio.Task[None]) -> None:
        if self.lanes.get(lane) is task:  # not already replaced by a newer response on the same lane
            del self.lanes[lane]

    async def _stream(self, lane: Lane, rid: str, grant: Grant, after: int | None) -> None:
        """Send response ``rid``'s events after sequence number ``after`` (None: all) on ``lane``."""
        try:
            view = await find_response(self.api, self.caller, rid)
            info = view.info
            try:
                at = resume_point(
                    after, info.completion_tokens, info.state in FINAL_STATES, info.state == "done"
                )
            except ValueError as exc:
                raise bad(f"{RESUME_PARAM}: {rid[:80]}: {exc}", param=RESUME_PARAM) from None
            events = ResponseEvents(
                rid, view.payload, info.state, at, extra={"stream_id": lane} if lane is not None else None
            )
            for ev in events.opening():
                await self._send(ev)
            async with self.api.follow(grant, self.caller.owner, rid[len(PREFIX) :]) as log:
                async for batch in log:
                    for ev in events.feed(batch):
                        await self._send(ev)
        except NotABoundary as exc:
            await self._error(bad(f"{RESUME_PARAM}: {exc}", param=RESUME_PARAM, code="resume_failed"), lane)
        except ApiError as exc:
            await self._error(exc, lane)
        except ConnectionClosed:
            pass
        finally:
            grant.release()  # following the log released it too, unless it never started

    async def _resume(self, target: str) -> None:
        """Continue the responses the handshake's ``tw_resume`` names, each after its sequence number."""
        values = parse_qs(urlsplit(target).query).get(RESUME_PARAM, [])
        points = [p for v in values for p in v.split(",") if p]
        cap = self.core.settings.max_streams_per_connection
        if len(points) > cap:
            await self._error(bad(f"{RESUME_PARAM}: at most {cap} responses", param=RESUME_PARAM), None)
            return
        for point in points:
            rid, _, raw = point.rpartition(":")
            lane: Lane = None
            try:
                after = parse_seq(raw)  # before the admission below: nothing is held if it fails
                if not rid or after is None:
                    raise bad(
                        f"{RESUME_PARAM}: {point[:80]!r} is not RESPONSE_ID:SEQUENCE_NUMBER", RESUME_PARAM
                    )
                # Admitted before the response is looked up: the lookup reads its whole log.
                grant = await self.api.admit(
                    self.caller, rid[len(PREFIX) :][:64], kind="resume", conn=self.limits
                )
                try:
                    view = await find_response(self.api, self.caller, rid)
                    stream_id = view.payload.get("stream_id")
                    lane = stream_id if isinstance(stream_id, str) else None
                    self._check_lane_free(lane)
                except BaseException:
                    grant.release()
                    raise
                self._start(lane, rid, grant, after)
            except ApiError as exc:
                await self._error(exc, lane)
            except ConnectionClosed:
                raise
            except Exception as exc:  # as for an event (_event): a bug must not end the connection
                self.log.error("responses_ws.resume_failed", exc_info=exc)
                await self._error(
                    ApiError(500, f"internal error: {type(exc).__name__}", code="internal"), lane
                )

    async def _send(self, event: dict[str, Any]) -> None:
        data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
        # A client that stops reading must not pile its events up here: it is closed (its responses run
        # on and it can resume them); a socket already closing fails at once (egress.py).
        await egress.send(self.ws, data, self.core.settings.slow_reader_timeout_s, self.log, "responses_ws")

    async def _error(self, exc: ApiError, lane: Lane) -> None:
        """An ``error`` event in OpenAI's WebSocket shape; the connection stays usable."""
        event: dict[str, Any] = {"type": "error", "status": exc.status, **exc.body()}
        if lane is not None:
            event["stream_id"] = lane
        with contextlib.suppress(ConnectionClosed):
            await self._send(event)


def _lane(value: object) -> Lane:
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_LANE_CHARS:
        raise bad(f"stream_id: a string of 1-{MAX_LANE_CHARS} characters", param="stream_id")
    return value
