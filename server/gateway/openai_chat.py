"""``POST /v1/chat/completions``: OpenAI's chat completions over tokenwire requests.

The body becomes a tokenwire ``chat`` in messages mode (validated by the protocol's own rules), the
``Idempotency-Key`` header its id. Streaming answers are SSE ``chat.completion.chunk`` events ending with
``data: [DONE]``; a retry with the same key and body replays the same generation from its start.
Anything tokenwire does not do gets a 400 naming the field, never silence.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from server.gateway.admission import Grant
from server.gateway.http_common import (
    SSE_HEADERS,
    ApiError,
    Caller,
    HttpCore,
    bad,
    check_fields,
    check_metadata,
    entry_error,
    json_response,
    optional_bool,
    prompt_cache_key,
    sse,
    text_content,
    usage,
)
from server.gateway.http_conn import HttpRequest, HttpResponse
from server.store.logs import LogEntry

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

# Fields tokenwire accepts only with the value that means "nothing special" (what many clients send by
# default); any other value is refused with a 400 naming the field.
NEUTRAL: dict[str, Any] = {
    "n": lambda v: type(v) is int and v == 1,  # not True, not 1.0 (SPEC §3: neither is an integer)
    "logprobs": lambda v: v is False,
    "logit_bias": lambda v: v == {},
    "tools": lambda v: v == [],
    "functions": lambda v: v == [],
    "parallel_tool_calls": lambda v: isinstance(v, bool),
    "response_format": lambda v: v == {"type": "text"},
    "modalities": lambda v: v == ["text"],
    "service_tier": lambda v: v in ("auto", "default"),
    "store": lambda v: v is False,
}
SUPPORTED = {
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "user",
    "prompt_cache_key",
    "safety_identifier",
    "metadata",  # accepted and kept with the request, as OpenAI does (not echoed: OpenAI does not either)
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",  # tokenwire's (and vLLM's) extension, sent by the SDK's extra_body
    "cache",  # tokenwire's extension: false = never answer from the response cache (SPEC 4.2)
}


def chat_messages(messages: object) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise bad("messages: expected a non-empty array of {role, content}", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where}: expected an object {{role, content}}", param=where)
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:  # a list or an object is not hashable
            raise bad(f"{where}.role: one of {', '.join(ROLES)}", param=f"{where}.role")
        for key, value in m.items():
            if key not in ("role", "content", "name") and value is not None:
                raise bad(f"{where}.{key[:40]}: not supported by tokenwire", param=f"{where}.{key[:40]}")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        out.append({"role": ROLES[role], "content": text_content(content, f"{where}.content", ("text",))})
    return out


class ChatCompletions:
    def __init__(self, api: HttpCore) -> None:
        self.api = api

    async def create(self, req: HttpRequest, caller: Caller, args: dict[str, str]) -> HttpResponse:
        api = self.api
        body = api.json_body(req)
        check_fields(body, SUPPORTED, NEUTRAL)
        model = api.check_model(body.get("model"))
        messages = chat_messages(body.get("messages"))
        stream = optional_bool(body, "stream")
        include_usage = False
        opts = body.get("stream_options")
        if opts is not None:
            if not stream or not isinstance(opts, dict):
                raise bad("stream_options: an object, only with stream: true", param="stream_options")
            for key, value in opts.items():
                if key != "include_usage" and value is not None:
                    raise bad(f"stream_options.{key[:40]}: not supported", param="stream_options")
            iu = opts.get("include_usage")
            if iu is not None and not isinstance(iu, bool):
                raise bad("stream_options.include_usage: expected a boolean", param="stream_options")
            include_usage = bool(iu)
        cache_key = prompt_cache_key(body)
        params: dict[str, Any] = {}
        mt, mct = body.get("max_tokens"), body.get("max_completion_tokens")
        if mt is not None and mct is not None and mt != mct:
            raise bad("max_tokens and max_completion_tokens differ; give one", param="max_completion_tokens")
        if mct is not None or mt is not None:
            params["max_tokens"] = mct if mct is not None else mt
        metadata = check_metadata(body.get("metadata"))
        for key in (
            "temperature",
            "top_p",
            "seed",
            "stop",
            "cache",
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
        ):
            if body.get(key) is not None:
                params[key] = body[key]
        params["model"] = model  # chooses the model as params.model does (unknown: 404)
        id, keyed = api.request_id(req)
        names = {"max_tokens": "max_completion_tokens"} if mct is not None else None
        chat = api.to_chat(id, messages, params, names)
        grant = await api.admit(caller, id, chat=chat)  # the one admission step, before anything is held
        try:
            extra = {"metadata": metadata} if metadata else {}
            model = (
                await api.submit(caller, chat, grant, kind="chat", extra=extra, cache_key=cache_key)
            ).model  # after any fallback
            cid = f"chatcmpl-{id}"
            created = int(time.time())
            if stream:
                resp = HttpResponse(
                    200,
                    list(SSE_HEADERS),
                    stream=self._stream(grant, caller, id, keyed, cid, created, model, include_usage),
                )
                resp.on_close.append(grant.release)  # if the stream never starts
                return resp
            return await self._wait(grant, caller, id, keyed, cid, created, model)
        except BaseException:
            grant.release()  # idempotent: following the log gives it back too
            raise

    async def _wait(
        self, grant: Grant, caller: Caller, id: str, keyed: bool, cid: str, created: int, model: str
    ) -> HttpResponse:
        text: list[str] = []
        end: LogEntry | None = None
        try:
            async with self.api.follow(grant, caller.owner, id) as log:
                async for batch in log:
                    text.extend(e.text for e in batch if e.finish is None)
                    if batch[-1].finish is not None:
                        end = batch[-1]
        except asyncio.CancelledError:
            if not keyed:  # nothing can ever re-attach to it: stop generating
                await self.api.cancel_quietly(caller.owner, id)
            raise
        assert end is not None
        if end.finish not in ("stop", "length"):
            raise entry_error(end)
        return json_response(
            {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "".join(text)},
                        "finish_reason": end.finish,
                        "logprobs": None,
                    }
                ],
                "usage": usage(end),
            }
        )

    async def _stream(
        self,
        grant: Grant,
        caller: Caller,
        id: str,
        keyed: bool,
        cid: str,
        created: int,
        model: str,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            obj: dict[str, Any] = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
            }
            if include_usage:
                obj["usage"] = None
            return sse(obj)

        ended = False
        try:
            yield chunk({"role": "assistant", "content": ""})
            try:
                async with self.api.follow(grant, caller.owner, id) as log:
                    async for batch in log:
                        text = "".join(e.text for e in batch if e.finish is None)
                        if text:
                            yield chunk({"content": text})
                        end = batch[-1]
                        if end.finish is None:
                            continue
                        ended = True
                        if end.finish in ("stop", "length"):
                            yield chunk({}, end.finish)
                            if include_usage:
                                yield sse(
                                    {
                                        "id": cid,
                                        "object": "chat.completion.chunk",
                                        "created": created,
                                        "model": model,
                                        "choices": [],
                                        "usage": usage(end),
                                    }
                                )
                        else:
                            yield sse(entry_error(end).body())
            except ApiError as exc:
                ended = True
                yield sse(exc.body())
            yield b"data: [DONE]\n\n"
        finally:
            if not ended and not keyed:
                await self.api.cancel_quietly(caller.owner, id)
