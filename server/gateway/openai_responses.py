"""The Responses API over HTTP, the subset that carries resume: create (``background``, ``stream``),
retrieve, stream again from ``starting_after``, cancel.

A response is an ordinary tokenwire request whose id is ``resp_`` + the request id. Its SSE events are
built by responses_events.py (shared with the WebSocket mode), whose sequence numbers map onto token
offsets: ``GET /v1/responses/{id}?stream=true&starting_after=N`` continues after event ``N`` on any
gateway, nothing repeated, nothing skipped. What a create body may hold is read by responses_request.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import parse_qs

from protocol import ErrorCode
from server.gateway.admission import Grant
from server.gateway.http_common import SSE_HEADERS, ApiError, Caller, HttpCore, bad, json_response, sse
from server.gateway.http_conn import HttpRequest, HttpResponse
from server.gateway.responses_events import (
    MAX_SEQ_DIGITS,
    PREFIX,
    NotABoundary,
    ResponseEvents,
    ResumePoint,
    error_of,
    parse_seq,
    response_object,
    resume_point,
    status_of,
)
from server.gateway.responses_request import find_response, plan_create
from server.store.requests import FINAL_STATES, RequestView


class Responses:
    def __init__(self, api: HttpCore) -> None:
        self.api = api

    async def create(self, req: HttpRequest, caller: Caller, args: dict[str, str]) -> HttpResponse:
        api = self.api
        id, keyed = api.request_id(req)
        plan = await plan_create(api, caller, api.json_body(req), id)
        stream, background = plan.stream, plan.background
        kind = "responses"
        # The one admission step; a background response that is not streamed holds no stream.
        grant = await api.admit(caller, id, stream=stream or not background, chat=plan.chat)
        try:
            await api.submit(
                caller,
                plan.chat,
                grant,
                kind=kind,
                extra=plan.extra,
                background=background,
                cache_key=plan.cache_key,
            )
            rid = PREFIX + id
            if stream:
                resp = HttpResponse(
                    200, list(SSE_HEADERS), stream=self._events(grant, caller, rid, None, background)
                )
                resp.on_close.append(grant.release)  # if the stream never starts
                return resp
            if background:
                grant.release()
                view = await find_response(api, caller, rid)
                return json_response(self._object(rid, view))
            try:
                await self._wait(grant, caller, id)
            except asyncio.CancelledError:
                if not keyed:  # the client never learnt the id: nothing can re-attach
                    await api.cancel_quietly(caller.owner, id)
                raise
        except BaseException:
            grant.release()  # idempotent: following the log gives it back too
            raise
        view = await find_response(api, caller, rid)
        if view.info.state == "failed" and view.error_code == ErrorCode.TOO_LARGE:
            # Answered as chat completions answers it (SPEC §15.6): the caller waited for a result and
            # there is none; the failed response can still be retrieved by its id.
            message = view.error_message or "the input does not fit the model"
            raise bad(f"{message} (response {rid}, failed)", "input", "context_length_exceeded")
        return json_response(self._object(rid, view))

    async def _wait(self, grant: Grant, caller: Caller, id: str) -> None:
        async with self.api.follow(grant, caller.owner, id) as log:
            async for _ in log:
                pass

    def _object(self, rid: str, view: RequestView) -> dict[str, Any]:
        info = view.info
        status = status_of(info.state, info.finish_reason)
        error = None
        if status == "failed":
            error = error_of(view.error_code, view.error_message)
        return response_object(
            rid,
            view.payload,
            status,
            view.text,
            info.prompt_tokens,
            info.completion_tokens,
            error,
            cached_tokens=info.cached_tokens,
        )

    async def retrieve(self, req: HttpRequest, caller: Caller, args: dict[str, str]) -> HttpResponse:
        rid = args["id"]
        query = parse_qs(req.query, keep_blank_values=True)
        stream = query.get("stream", ["false"])[-1].lower()
        if stream not in ("true", "false"):
            raise bad("stream: true or false", param="stream")
        after: int | None = None
        if "starting_after" in query:
            after = parse_seq(query["starting_after"][-1])
            if after is None:
                raise bad(
                    f"starting_after: a non-negative integer of at most {MAX_SEQ_DIGITS} digits",
                    param="starting_after",
                )
        # A retrieve reads the whole log: admitted as a resume before the store is asked anything.
        grant = await self.api.admit(caller, rid[len(PREFIX) :], kind="resume", stream=stream == "true")
        try:
            view = await find_response(self.api, caller, rid)
            if stream == "false":
                return json_response(self._object(rid, view))
            info = view.info
            try:
                resume_point(
                    after,
                    info.completion_tokens,
                    info.state in FINAL_STATES,
                    info.state == "done",
                )
            except ValueError as exc:
                raise bad(f"starting_after: {exc}", param="starting_after") from None
        except BaseException:
            grant.release()
            raise
        background = bool(view.payload.get("background"))
        events = self._events(grant, caller, rid, after, background)
        resp = HttpResponse(200, list(SSE_HEADERS), stream=events)
        resp.on_close.append(grant.release)  # if the stream never starts
        return resp

    async def cancel(self, req: HttpRequest, caller: Caller, args: dict[str, str]) -> HttpResponse:
        rid = args["id"]
        (await self.api.admit(caller, rid[len(PREFIX) :], kind="cancel", stream=False)).release()
        await find_response(self.api, caller, rid)
        await self.api.cancel(caller.owner, rid[len(PREFIX) :])  # idempotent: an ended one is unchanged
        return json_response(self._object(rid, await find_response(self.api, caller, rid)))

    async def _events(
        self, grant: Grant, caller: Caller, rid: str, after: int | None, background: bool
    ) -> AsyncIterator[bytes]:
        """The response's SSE events after sequence number ``after`` (None: from the start). Follows the
        log from 0 to know the full text for the closing events (responses_events.py sends only what
        comes after ``after``)."""
        id = rid[len(PREFIX) :]
        view = await find_response(self.api, caller, rid)
        info = view.info
        at = ResumePoint()
        try:
            at = resume_point(
                after,
                info.completion_tokens,
                info.state in FINAL_STATES,
                info.state == "done",
            )
        except ValueError as exc:
            yield _error(after or 0, "resume_failed", f"starting_after: {exc}", "starting_after")
            return
        events = ResponseEvents(rid, view.payload, info.state, at)
        for ev in events.opening():
            yield sse(ev, event=ev["type"])
        try:
            # Not attached for background responses: they must not be cancelled by the detach timeout.
            async with self.api.follow(grant, caller.owner, id, attached=not background) as log:
                async for batch in log:
                    for ev in events.feed(batch):
                        yield sse(ev, event=ev["type"])
        except NotABoundary as exc:
            yield _error(after or 0, "resume_failed", str(exc), "starting_after")
        except ApiError as exc:
            yield _error(after or 0, exc.code or "error", exc.message, exc.param)


def _error(seq: int, code: str, message: str, param: str | None) -> bytes:
    """An ``error`` event; it is not one of the response's own events, so it repeats the number the
    stream resumed after rather than taking one of the response's numbers."""
    return sse(
        {"type": "error", "sequence_number": seq, "code": code, "message": message, "param": param},
        event="error",
    )
