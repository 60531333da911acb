"""What a Responses ``create`` asks for, read from its body: shared by ``POST /v1/responses``
(openai_responses.py) and the WebSocket mode's ``response.create`` (openai_responses_ws.py), so both
doors accept, refuse and continue conversations by exactly the same rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from protocol import Chat
from server.gateway.admission import ConnectionLimits
from server.gateway.http_common import (
    ApiError,
    Caller,
    HttpCore,
    bad,
    check_fields,
    check_metadata,
    optional_bool,
    prompt_cache_key,
    text_content,
)
from server.gateway.responses_events import PREFIX
from server.store.requests import RequestView

SUPPORTED = {
    "model",
    "repetition_penalty",  # tokenwire's extension (the SDK's extra_body), as on chat completions
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
    "prompt_cache_key",
    "safety_identifier",
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
# Content parts a client may send that tokenwire cannot read: named in the refusal, so that a client
# learns at once that it must send text.
MEDIA_PARTS = {"input_image": "images", "input_file": "files", "input_audio": "audio"}
TEXT_PARTS = ("input_text", "output_text", "text")


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
            kind = item.get("type") if isinstance(item, dict) else None
            what = f" ({str(kind)[:40]!r} items: tools are not supported)" if isinstance(kind, str) else ""
            raise bad(f"{where}: only messages {{role, content}} are supported{what}", param=where)
        role = item.get("role")
        if not isinstance(role, str) or role not in ROLES:  # a list or an object is not hashable
            raise bad(f"{where}.role: one of {', '.join(ROLES)}", param=f"{where}.role")
        content = item.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                media = MEDIA_PARTS.get(kind) if isinstance(kind, str) else None
                if media is not None:
                    raise bad(
                        f"{where}.content[{j}]: {media} are not supported by tokenwire (text parts only)",
                        param=f"{where}.content[{j}]",
                        code="unsupported_parameter",
                    )
        out.append({"role": ROLES[role], "content": text_content(content, f"{where}.content", TEXT_PARTS)})
    return out


def check_body(body: dict[str, Any]) -> None:
    """Refuse fields tokenwire does not do, naming tools first (the field a client most often sends)."""
    tools = body.get("tools")
    if tools is not None and tools != []:
        raise bad(
            "tools: tokenwire generates text only; tools (functions, web or file search, MCP, images) are"
            " not supported",
            param="tools",
            code="unsupported_parameter",
        )
    check_fields(body, SUPPORTED, NEUTRAL)


async def find_response(api: HttpCore, caller: Caller, rid: str) -> RequestView:
    """This owner's response ``rid``; 404 alike for unknown ids and other owners' ids."""
    view = None
    if rid.startswith(PREFIX) and len(rid) > len(PREFIX):
        view = await api.view(caller.owner, rid[len(PREFIX) :])
    if view is None or view.payload.get("api") != "responses":
        raise ApiError(404, f"no response with id {rid[:80]!r}", code="not_found")
    return view


@dataclass(frozen=True, slots=True)
class CreatePlan:
    """A create body, read: the chat to submit, the fields the response object echoes (``extra``), and
    ``conversation``: the messages a later ``previous_response_id`` continues (without instructions)."""

    chat: Chat
    extra: dict[str, Any]
    conversation: list[dict[str, str]]
    stream: bool
    background: bool
    cache_key: str  # http_common.prompt_cache_key


async def plan_create(
    api: HttpCore,
    caller: Caller,
    body: dict[str, Any],
    id: str,
    *,
    local: Mapping[str, list[dict[str, str]]] | None = None,
    conn: ConnectionLimits | None = None,
) -> CreatePlan:
    """Read a create body into the chat it asks for. ``local``: responses known only to this connection
    (WebSocket warm-ups) by id, with their conversations; ``conn``: that connection's limits. Raises
    ApiError naming the field (or 429 when reading the previous response is not admitted)."""
    check_body(body)
    model = api.check_model(body.get("model"))
    if body.get("input") is None:
        raise bad("input: required (a string or an array of messages)", param="input")
    new = input_messages(body.get("input"))
    flags = {key: optional_bool(body, key) for key in ("stream", "background", "store")}
    stream, background = bool(flags["stream"]), bool(flags["background"])
    if background and flags["store"] is False:
        raise bad("background: needs store (a background response is kept to be retrieved)", "store")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions: expected a string", param="instructions")
    metadata = check_metadata(body.get("metadata"))
    cache_key = prompt_cache_key(body)
    history: list[dict[str, str]] = []
    prev_id = body.get("previous_response_id")
    if prev_id is not None and not isinstance(prev_id, str):
        raise bad("previous_response_id: expected a string", param="previous_response_id")
    if prev_id == "":
        prev_id = None  # SPEC §15.4: null or "" continue nothing (SDKs send "" for "none")
    if prev_id is not None:
        if local is not None and prev_id in local:
            history = list(local[prev_id])  # a warm-up: its conversation, nothing generated
        else:
            # Reading the previous response reads its whole log: admitted as a resume first (§15.2).
            read = prev_id[len(PREFIX) :] if prev_id.startswith(PREFIX) else prev_id
            (await api.admit(caller, read[:64], kind="resume", stream=False, conn=conn)).release()
            prev = await find_response(api, caller, prev_id)
            if prev.info.state in ("queued", "running"):
                raise bad("previous_response_id: that response has not completed", "previous_response_id")
            if prev.info.state != "done":  # failed or cancelled: no conversation to continue (SPEC §15.4)
                raise ApiError(
                    404,
                    f"previous_response_id: that response is {prev.info.state}, not completed or incomplete",
                    param="previous_response_id",
                    code="not_found",
                )
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
        ("repetition_penalty", "repetition_penalty"),
    ):
        if body.get(key) is not None:
            params[wire] = body[key]
    params["model"] = model  # chooses the model as params.model does (unknown: 404)
    # "messages" is the input (with any earlier turns): a refusal of their count names the body's field.
    chat = api.to_chat(id, messages, params, {"max_tokens": "max_output_tokens", "messages": "input"})
    extra = {
        "instructions": instructions,
        "previous_response_id": prev_id,
        "background": background,
        "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "metadata": metadata,
        # Echoed as sent (http_common.prompt_cache_key checked them), kept only when sent.
        **{k: body[k] for k in ("prompt_cache_key", "safety_identifier", "user") if body.get(k) is not None},
    }
    return CreatePlan(chat, extra, history + new, stream, background, cache_key)
