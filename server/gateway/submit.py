"""Turning an admitted chat into a request in the store: the one path every door takes (the WebSocket
``chat`` in connection.py, the OpenAI-compatible HTTP API in openai_chat.py and openai_responses.py).
It runs only with an admission grant (admission.py), taken once.

It applies the server's defaults, picks the model, walks the degradation ladder under load, computes the
response-cache key and submits. Outcomes a client must hear about are raised as ``ProtocolError``; the
HTTP API maps them to its status codes.

**The degradation ladder** (README "Degradation", SPEC.md §4.2), in this order, for a new chat whose
model is past a threshold (``--degrade-queue-depth``, ``--degrade-ttft``):

1. clamp ``max_tokens`` to ``--degrade-max-tokens``;
2. trim the context to the system prompt and the latest ``--degrade-context-messages`` messages;
3. send it to the model's fallback (``--fallback MODEL=LIGHT``) when the chat allows it
   (``params.fallback``, default true) and the light model is served and not past a threshold itself;
   also when the model's queue is full (``--max-queued``), before refusing;
4. ``overloaded``: the chosen model's queue is full.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from protocol import Chat, ErrorCode, Params, ProtocolError
from server import metrics
from server.gateway.admission import Grant, limited, require
from server.gateway.degradation import Degradation
from server.gateway.models import Choice, ModelRegistry
from server.gateway.routing import Router
from server.gateway.settings import GatewaySettings
from server.store.requests import RequestStore, SubmitResult

# Keys of params that choose where and how long a chat runs, not how it samples: kept out of the sampling
# parameters the worker reads (the chosen model travels on its own, and is part of the response-cache key;
# the detach timeout is the store's, submit below).
NOT_SAMPLING_PARAMS = ("model", "fallback", "detach_timeout_ms")


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """What a door asks for. ``messages`` is the whole conversation (a content-mode turn: the session's
    history plus the new user message); ``fingerprint`` decides retry vs. idempotency conflict."""

    owner: str
    chat: Chat
    messages: list[dict[str, str]]
    fingerprint: str
    session: str = ""
    user_message: dict[str, str] | None = None  # content mode: appended to the history at the end
    turn_after: str | None = None  # content mode: the session's previous turn, waited for
    extra: dict[str, Any] = field(default_factory=dict)  # more payload (the HTTP API's own fields)
    detach_timeout_ms: int | None = None  # a background HTTP response: nobody needs to stay attached
    # OpenAI's prompt_cache_key (or its user): the requests of one owner with one key go to one worker,
    # and within a pooled owner they are one caller for prompt reuse (engine/api.GenerationRequest).
    prompt_cache_key: str = ""


@dataclass(frozen=True, slots=True)
class Submitted:
    result: SubmitResult  # outcome "new", "attach", "cached" or "turn_moved" (the others are raised)
    model: str  # the model that serves it (an attached request: the one it was given)
    fell_back: bool = False


def degrade(
    messages: list[dict[str, str]], params: dict[str, object], st: GatewaySettings
) -> tuple[list[dict[str, str]], dict[str, object]]:
    """Rungs 1 and 2 of the ladder: a cheaper version of a chat, fewer tokens out, less context in."""
    max_tokens = params.get("max_tokens")
    if isinstance(max_tokens, int) and max_tokens > st.degrade_max_tokens:
        params = {**params, "max_tokens": st.degrade_max_tokens}
        metrics.DEGRADED.labels("clamp_max_tokens").inc()
    system = [m for m in messages[:1] if m.get("role") == "system"]
    rest = messages[len(system) :]
    if len(rest) > st.degrade_context_messages:
        messages = system + rest[-st.degrade_context_messages :]
        metrics.DEGRADED.labels("truncate_context").inc()
    return messages, params


def response_cache_key(
    messages: list[dict[str, str]], params: dict[str, object], asked: Params, model: str = ""
) -> str:
    """The response-cache key of a deterministic request, or "" if it is not one (or opted out).

    Deterministic: greedy (temperature 0: the seed does not matter and is left out) or a seed the client
    chose. The key covers the model that answers, the whole prompt (history included) and every
    sampling parameter.
    """
    if asked.cache is False:
        return ""
    greedy = params.get("temperature") == 0
    if not greedy and asked.seed is None:
        return ""
    basis = {k: v for k, v in params.items() if k != "cache" and not (greedy and k == "seed")}
    body: dict[str, Any] = {"m": messages, "p": basis}
    if model:
        body["model"] = model
    raw = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(raw.encode()).hexdigest()


class Submitter:
    """The submit path: defaults, model choice, the degradation ladder, the response cache, the store."""

    def __init__(
        self,
        settings: GatewaySettings,
        store: RequestStore,
        models: ModelRegistry,
        router: Router,
        degradation: Degradation,
    ) -> None:
        self.settings = settings
        self.store = store
        self.models = models
        self.router = router
        self.degradation = degradation

    def detach_timeout(self, asked: Params) -> int | None:
        """The chat's own detach timeout (SPEC 4.2): ``params.detach_timeout_ms`` lowered to this server's
        cap, or None where that is not longer than the store's default (which then applies)."""
        want = min(asked.detach_timeout_ms or 0, self.settings.max_detach_timeout_ms)
        return want if want > self.store.settings.detach_timeout_ms else None

    async def _fallback_for(self, model: Choice, asked: Params) -> Choice | None:
        """Rung 3: the light model this chat may move to now, or None."""
        light = self.settings.fallback_for(model.name)
        if light is None or asked.fallback is False or light == model.name:
            return None
        served = await self.models.served()
        if light not in served.names:
            return None  # not up (a cluster whose light workers are gone): stay, and let the queue decide
        choice = Choice(light, served.route(light))
        if await self.degradation.degraded(choice):
            return None  # the light model is overloaded too: moving would not help
        return choice

    async def submit(self, req: ChatRequest, grant: Grant) -> Submitted:
        """Create the request (or attach to the one with this id), once per grant. Raises ProtocolError:
        model_not_found, idempotency_conflict, rate_limited (the per-user in-flight cap), overloaded."""
        require(grant)
        if grant.submitted:
            raise RuntimeError("a grant admits one submit")
        grant.end_wait()
        st = self.settings
        chat = req.chat
        params = {k: v for k, v in chat.params.to_wire().items() if k not in NOT_SAMPLING_PARAMS}
        # The server's own limit, advertised in welcome.limits.max_tokens, caps what a client asks for.
        params["max_tokens"] = min(params.get("max_tokens", st.default_max_tokens), st.max_tokens)
        if chat.params.seed is None:
            # A fixed seed per request makes a re-run (another worker after a crash) draw the same text.
            params["seed"] = secrets.randbits(63)
        messages = req.messages
        model = asked = await self.models.choose(chat.params.model, chat.id)
        fell_back = False
        if await self.degradation.degraded(model):
            messages, params = degrade(messages, params, st)  # rungs 1 and 2
            light = await self._fallback_for(model, chat.params)  # rung 3
            if light is not None:
                model, fell_back = light, True
        while True:
            res = await self._submit_to(req, grant, model, messages, params)
            if res.outcome == "overloaded" and not fell_back:
                # Its queue is full: the light model, if any, before refusing (rung 3 before rung 4).
                light = await self._fallback_for(model, chat.params)
                if light is not None:
                    model, fell_back = light, True
                    continue
            break
        if res.outcome == "turn_moved":
            return Submitted(res, model.name)  # the door waits for that turn too, then submits again
        grant.submitted = True
        metrics.REQUESTS.labels(res.outcome).inc()
        if res.outcome == "user_limit":
            cap = self.store.settings.max_inflight_per_user
            raise limited(chat.id, f"at most {cap} requests queued or running per user", 1000)
        if res.outcome == "conflict":
            raise ProtocolError(
                ErrorCode.IDEMPOTENCY_CONFLICT,
                "id: a different request already uses this id; use a new id for a new request",
                id=chat.id,
            )
        if res.outcome == "overloaded":
            # An estimate: the queue ahead drains at roughly one request per 100 ms per worker here.
            workers = max(1, len(await self.store.live_workers()))
            raise ProtocolError(
                ErrorCode.OVERLOADED,
                "the server's queue is full; retry later",
                id=chat.id,
                retry_after_ms=min(30_000, 250 + 100 * res.queued // workers),
            )
        if res.outcome == "attach":
            # A retry: the request keeps the model it was given (maybe a fallback, maybe before a restart).
            info = await self.store.get(req.owner, chat.id)
            return Submitted(res, (info.model if info is not None else "") or model.name)
        if fell_back and res.outcome in ("new", "cached"):
            metrics.FALLBACKS.labels(asked.name, model.name).inc()
        return Submitted(res, model.name, fell_back)

    async def _submit_to(
        self,
        req: ChatRequest,
        grant: Grant,
        model: Choice,
        messages: list[dict[str, str]],
        params: dict[str, Any],
    ) -> SubmitResult:
        st = self.settings
        payload: dict[str, Any] = {
            "owner": req.owner,
            "id": req.chat.id,
            "session": req.session,
            "messages": messages,
            "params": params,
            **req.extra,
            "model": model.name,
            "route": model.route,
        }
        if grant.weight != 1.0:
            payload["weight"] = grant.weight  # the worker's engine shares itself by weighted service
        own_detach = self.detach_timeout(req.chat.params)
        if req.prompt_cache_key:
            # Not "prompt_cache_key": a response echoes that field as the client sent it (extra), and
            # this one may be its user.
            payload["reuse_key"] = req.prompt_cache_key
        cache_key = (
            response_cache_key(messages, params, req.chat.params, model.name) if st.response_cache else ""
        )
        # Session affinity (a worker whose KV cache holds the earlier turns) for the default model only;
        # a conversation without a session (the OpenAI doors) has it by its prompt_cache_key.
        place = req.session or (f"\0key\0{req.owner}\0{req.prompt_cache_key}" if req.prompt_cache_key else "")
        prefer = await self.router.prefer(place) if place and not model.route else ""
        res = await self.store.submit(
            req.owner,
            req.chat.id,
            req.fingerprint,
            payload,
            session=req.session,
            user_message=req.user_message,
            prefer=prefer,
            cache_key=cache_key,
            shared_cache=st.shared_response_cache,
            turn_after=req.turn_after,
            detach_timeout_ms=req.detach_timeout_ms if req.detach_timeout_ms is not None else own_detach,
            keep_detach_timeout=own_detach is not None,
            model=model.name,
            route=model.route,
        )
        if cache_key and res.outcome in ("new", "cached"):
            metrics.CACHE.labels("hit" if res.outcome == "cached" else "miss").inc()
        return res
