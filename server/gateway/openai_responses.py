"""The Responses API, the subset that carries resume: create (``background``, ``stream``), retrieve,
stream again from ``starting_after``, cancel.

A response is an ordinary tokenwire request whose id is ``resp_`` + the request id. Its SSE
``sequence_number`` is a token offset: a ``response.output_text.delta`` covering tokens ``[o, o+n)`` has
``sequence_number`` ``o+n``, so a client that saw sequence number ``N`` holds exactly the first ``N``
tokens' text, and ``GET /v1/responses/{id}?stream=true&starting_after=N`` continues at token ``N`` on any
gateway: nothing repeated, nothing skipped. Lifecycle events carry the offset at which they happen.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import parse_qs

from server.gateway.admission import Grant
from server.gateway.http_common import (
    SSE_HEADERS,
    ApiError,
    Caller,
    HttpCore,
    bad,
    check_fields,
    json_response,
    sse,
    text_content,
)
from server.gateway.http_conn import HttpRequest, HttpResponse
from server.store.requests import RequestView

PREFIX = "resp_"
SUPPORTED = {
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "background",
    "previous_response_id",
    "store",
    "user",
    "metadata",
}
NEUTRAL: dict[str, Any] = {
    "tools": lambda v: v == [],
    "tool_choice": lambda v: v in ("auto", "none"),
    "parallel_tool_calls": lambda v: isinstance(v, bool),
    "truncation": lambda v: v == "disabled",
    "text": lambda v: v == {"format": {"type": "text"}},
    "include": lambda v: v == [],
    "service_tier": lambda v: v in ("auto", "default"),
}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
STATUS = {"queued": "queued", "running": "in_progress", "failed": "failed", "cancelled": "cancelled"}


def input_messages(value: object) -> list[dict[str, str]]:
    if isinstance(value, str):
        if not value:
            raise bad("input: must not be empty", param="input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad("input: a string or a non-empty array of messages", param="input")
    out = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            raise bad(f"{where}: only messages {{role, content}} are supported", param=where)
        role = item.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role: one of {', '.join(ROLES)}", param=f"{where}.role")
        content = text_content(item.get("content"), f"{where}.content", ("input_text", "output_text", "text"))
        out.append({"role": ROLES[role], "content": content})
    return out


def status_of(state: str, finish: str | None) -> str:
    if state == "done":
        return "incomplete" if finish == "length" else "completed"
    return STATUS.get(state, "in_progress")


def response_object(
    rid: str,
    payload: dict[str, Any],
    status: str,
    text: str,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    error: dict[str, str] | None = None,
) -> dict[str, Any]:
    final = status in ("completed", "incomplete", "failed", "cancelled")
    output = []
    if text or (final and status != "failed"):
        output.append(
            {
                "type": "message",
                "id": f"msg_{rid[len(PREFIX) :]}",
                "status": "in_progress"
                if not final
                else ("incomplete" if status != "completed" else "completed"),
                "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
            }
        )
    return {
        "id": rid,
        "object": "response",
        "created_at": payload.get("created", 0),
        "status": status,
        "background": bool(payload.get("background")),
        "model": payload.get("model", ""),
        "instructions": payload.get("instructions"),
        "previous_response_id": payload.get("previous_response_id"),
        "max_output_tokens": payload.get("max_output_tokens"),
        "temperature": payload.get("temperature"),
        "top_p": payload.get("top_p"),
        "metadata": payload.get("metadata") or {},
        "output": output,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "usage": {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens,
        }
        if final
        else None,
        "parallel_tool_calls": False,
        "tool_choice": "auto",
        "tools": [],
        "text": {"format": {"type": "text"}},
    }


def _error(code: str, message: str) -> dict[str, str]:
    return {"code": code or "server_error", "message": message or "generation failed"}


class Responses:
    def __init__(self, api: HttpCore) -> None:
        self.api = api

    async def _find(self, caller: Caller, rid: str) -> RequestView:
        """This owner's response ``rid``; 404 alike for unknown ids and other owners' ids."""
        view = None
        if rid.startswith(PREFIX) and len(rid) > len(PREFIX):
            view = await self.api.view(caller.owner, rid[len(PREFIX) :])
        if view is None or view.payload.get("api") != "responses":
            raise ApiError(404, f"no response with id {rid[:80]!r}", code="not_found")
        return view

    async def create(self, req: HttpRequest, caller: Caller, args: dict[str, str]) -> HttpResponse:
        api = self.api
        body = api.json_body(req)
        check_fields(body, SUPPORTED, NEUTRAL)
        model = api.check_model(body.get("model"))
        if body.get("input") is None:
            raise bad("input: required (a string or an array of messages)", param="input")
        new = input_messages(body.get("input"))
        flags = {}
        for key in ("stream", "background", "store"):
            v = body.get(key)
            if v is not None and not isinstance(v, bool):
                raise bad(f"{key}: expected a boolean", param=key)
            flags[key] = v
        stream, background = bool(flags["stream"]), bool(flags["background"])
        if background and flags["store"] is False:
            raise bad("background: needs store (a background response is kept to be retrieved)", "store")
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise bad("instructions: expected a string", param="instructions")
        metadata = body.get("metadata")
        if metadata is not None and (
            not isinstance(metadata, dict)
            or len(metadata) > 16
            or not all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                for k, v in metadata.items()
            )
        ):
            raise bad("metadata: at most 16 string keys (64 chars) and string values (512)", "metadata")
        history: list[dict[str, str]] = []
        prev_id = body.get("previous_response_id")
        if prev_id is not None:
            if not isinstance(prev_id, str):
                raise bad("previous_response_id: expected a string", param="previous_response_id")
            prev = await self._find(caller, prev_id)
            if prev.info.state != "done":
                raise bad("previous_response_id: that response has not completed", "previous_response_id")
            # Its conversation without its own instructions (they do not carry over), then its answer.
            msgs = prev.payload.get("messages") or []
            history = list(msgs[1:] if prev.payload.get("instructions") else msgs)
            history.append({"role": "assistant", "content": prev.text})
        messages = ([{"role": "system", "content": instructions}] if instructions else []) + history + new
        params: dict[str, Any] = {}
        for key, wire in (
            ("max_output_tokens", "max_tokens"),
            ("temperature", "temperature"),
            ("top_p", "top_p"),
        ):
            if body.get(key) is not None:
                params[wire] = body[key]
        params["model"] = model  # chooses the model as params.model does (unknown: 404)
        id, keyed = api.request_id(req)
        chat = api.to_chat(id, messages, params)
        extra = {
            "instructions": instructions,
            "previous_response_id": prev_id,
            "background": background,
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "metadata": metadata or {},
        }
        kind = "responses"
        # The one admission step; a background response that is not streamed holds no stream.
        grant = await api.admit(caller, id, stream=stream or not background, chat=chat)
        try:
            await api.submit(caller, chat, grant, kind=kind, extra=extra, background=background)
            rid = PREFIX + id
            if stream:
                resp = HttpResponse(
                    200, list(SSE_HEADERS), stream=self._events(grant, caller, rid, None, background)
                )
                resp.on_close.append(grant.release)  # if the stream never starts
                return resp
            if background:
                grant.release()
                view = await self._find(caller, rid)
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
        return json_response(self._object(rid, await self._find(caller, rid)))

    async def _wait(self, grant: Grant, caller: Caller, id: str) -> None:
        async for _ in self.api.follow(grant, caller.owner, id):
            pass

    def _object(self, rid: str, view: RequestView) -> dict[str, Any]:
        info = view.info
        status = status_of(info.state, info.finish_reason)
        error = None
        if status == "failed":
            error = _error(view.error_code, view.error_message)
        return response_object(
            rid, view.payload, status, view.text, info.prompt_tokens, info.completion_tokens, error
        )

    async def retrieve(self, req: HttpRequest, caller: Caller, args: dict[str, str]) -> HttpResponse:
        rid = args["id"]
        query = parse_qs(req.query, keep_blank_values=True)
        stream = query.get("stream", ["false"])[-1].lower()
        if stream not in ("true", "false"):
            raise bad("stream: true or false", param="stream")
        after: int | None = None
        if "starting_after" in query:
            raw = query["starting_after"][-1]
            if not raw.isdigit() or len(raw) > 12:
                raise bad("starting_after: a non-negative integer", param="starting_after")
            after = int(raw)
        view = await self._find(caller, rid)
        if stream == "false":
            return json_response(self._object(rid, view))
        if after is not None and after > view.info.completion_tokens:
            raise bad(
                f"starting_after: {after} is past the {view.info.completion_tokens} tokens generated so far",
                param="starting_after",
            )
        background = bool(view.payload.get("background"))
        grant = await self.api.admit(caller, rid[len(PREFIX) :], kind="resume")
        events = self._events(grant, caller, rid, after, background)
        resp = HttpResponse(200, list(SSE_HEADERS), stream=events)
        resp.on_close.append(grant.release)  # if the stream never starts
        return resp

    async def cancel(self, req: HttpRequest, caller: Caller, args: dict[str, str]) -> HttpResponse:
        rid = args["id"]
        await self._find(caller, rid)
        await self.api.cancel(caller.owner, rid[len(PREFIX) :])  # idempotent: an ended one is unchanged
        return json_response(self._object(rid, await self._find(caller, rid)))

    async def _events(
        self, grant: Grant, caller: Caller, rid: str, after: int | None, background: bool
    ) -> AsyncIterator[bytes]:
        """The response's SSE events: from the start (``after`` None), or the text after token ``after``
        followed by the closing events. Follows the log from 0 to know the full text for the closing
        events, and sends deltas only past ``after``."""
        id = rid[len(PREFIX) :]
        view = await self._find(caller, rid)
        payload = view.payload
        item_id = f"msg_{id}"

        def ev(kind: str, seq: int, **fields: Any) -> bytes:
            return sse({"type": kind, "sequence_number": seq, **fields}, event=kind)

        if after is None:
            snapshot = response_object(rid, payload, STATUS.get(view.info.state, "in_progress"), "")
            yield ev("response.created", 0, response=snapshot)
            yield ev("response.in_progress", 0, response={**snapshot, "status": "in_progress"})
            item = {
                "type": "message",
                "id": item_id,
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            yield ev("response.output_item.added", 0, output_index=0, item=item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield ev(
                "response.content_part.added", 0, item_id=item_id, output_index=0, content_index=0, part=part
            )
        start = after or 0
        text: list[str] = []
        try:
            # Not attached for background responses: they must not be cancelled by the detach timeout.
            async for batch in self.api.follow(grant, caller.owner, id, attached=not background):
                out = []
                for e in batch:
                    if e.finish is not None:
                        continue
                    text.append(e.text)
                    if e.offset >= start:
                        out.append(e.text)
                    elif e.offset + e.n > start:
                        yield ev(
                            "error",
                            start,
                            code="resume_failed",
                            message=f"starting_after {start} is not at a delta boundary of this response",
                            param="starting_after",
                        )
                        return
                end = batch[-1]
                seq = end.offset + end.n
                if out:
                    delta = "".join(out)
                    yield ev(
                        "response.output_text.delta",
                        seq,
                        item_id=item_id,
                        output_index=0,
                        content_index=0,
                        delta=delta,
                        logprobs=[],
                    )
                if end.finish is None:
                    continue
                full = "".join(text)
                if end.finish in ("stop", "length"):
                    status = "incomplete" if end.finish == "length" else "completed"
                    final = response_object(rid, payload, status, full, end.prompt_tokens, end.offset)
                    part = {"type": "output_text", "text": full, "annotations": [], "logprobs": []}
                    yield ev(
                        "response.output_text.done",
                        seq,
                        item_id=item_id,
                        output_index=0,
                        content_index=0,
                        text=full,
                        logprobs=[],
                    )
                    yield ev(
                        "response.content_part.done",
                        seq,
                        item_id=item_id,
                        output_index=0,
                        content_index=0,
                        part=part,
                    )
                    yield ev("response.output_item.done", seq, output_index=0, item=final["output"][0])
                    yield ev(f"response.{status}", seq, response=final)
                else:
                    status = "cancelled" if end.finish == "cancelled" else "failed"
                    error = _error(end.error_code, end.error_message) if status == "failed" else None
                    final = response_object(rid, payload, status, full, end.prompt_tokens, end.offset, error)
                    yield ev("response.failed", seq, response=final)
                return
        except ApiError as exc:
            yield ev("error", start, code=exc.code or "error", message=exc.message, param=exc.param)
