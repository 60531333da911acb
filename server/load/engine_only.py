"""``tokenwire load --engine-only``: the same workload as a ``tokenwire load`` run, fed straight into an
engine in this process, with no socket, no Redis and no gateway.

It exists so that "end to end / engine-only" compares like with like: the same users (closed or open
loop), the same seeded prompts, output lengths and sampling seeds (drawn through
``conversation.draw_request``, as the WebSocket users draw them), the same chat template, EOS honoured in
both, and the report measured the same way (tokens over the window from the first request to the last
finish; TTFT from submit to the first token; inter-token latency per token). What is left out is exactly
what the server adds: the gateway, the Redis hand-off and log, the worker loop and the wire.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from server.engine.api import EngineOverloaded, GenerationRequest, StepOutput
from server.engine.prompt import PromptTooLarge
from server.load.conversation import RequestRecord, conversation_rng, draw_request, system_prompt
from server.load.runner import LoadResult, RunState, drive
from server.worker.loop import params_from_payload

SERVER_NAME = "engine-only"


@dataclass(slots=True)
class _Pending:
    rec: RequestRecord
    done: asyncio.Future[None]
    text: list[str] = field(default_factory=list)
    last: float | None = None


class EngineDriver:
    """Submits requests to an engine and turns its per-step outputs back into request records."""

    def __init__(self, engine: Any, state: RunState) -> None:
        self.engine = engine
        self.state = state
        self.pending: dict[str, _Pending] = {}
        self.loop = asyncio.get_running_loop()

    def start(self) -> None:
        # The engine calls back on its own thread once per step; the records are touched on the loop only.
        self.engine.start(lambda outs: self.loop.call_soon_threadsafe(self._on_step, outs))

    def _on_step(self, outs: list[StepOutput]) -> None:
        now = self.state.now()
        for o in outs:
            p = self.pending.get(o.key)
            if p is None:
                continue
            rec = p.rec
            if o.n:
                if rec.first_at is None:
                    rec.first_at = now
                elif p.last is not None:
                    rec.itl.extend([(now - p.last) / o.n] * o.n)
                p.last = now
                p.text.append(o.text)
                rec.tokens += o.n
                self.state.add_tokens(o.n, now)
            if o.finish is not None:
                rec.done_at = now
                rec.prompt_tokens = o.prompt_tokens
                rec.cached_tokens = o.cached_tokens
                rec.finish_reason = o.finish
                rec.length_reason = o.length_reason or None
                if o.finish == "error":
                    rec.error_code = o.error_code or "finish_error"
                del self.pending[o.key]
                p.done.set_result(None)

    async def generate(self, rec: RequestRecord, request: GenerationRequest) -> str:
        """Run one request to its finish; returns its text."""
        p = _Pending(rec, self.loop.create_future())
        self.pending[request.key] = p
        prepare = getattr(self.engine, "prepare", None)
        if callable(prepare):  # as the worker does: template and tokenise off the loop, off the engine
            try:
                request = await self.loop.run_in_executor(None, prepare, request)
            except PromptTooLarge:
                self.pending.pop(request.key, None)
                rec.error_code, rec.finish_reason = "too_large", "error"
                return ""
        while True:
            try:
                self.engine.submit(request)
                break
            except EngineOverloaded as exc:  # as the worker would: the client retries after the hint
                rec.retries += 1
                await asyncio.sleep(exc.retry_after_ms / 1000)
        await p.done
        return "".join(p.text)


async def _conversation(driver: EngineDriver, user: int, conversation: int) -> None:
    st = driver.state
    cfg = st.cfg
    rng = conversation_rng(cfg.seed, user, conversation)
    session = f"{st.tag}-{user}-{conversation}"
    system = system_prompt(cfg)
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    for turn in range(cfg.turns):
        if turn and cfg.think > 0:
            await asyncio.sleep(rng.expovariate(1.0 / cfg.think))
        if not st.take_ticket():
            return
        chat, rec = draw_request(cfg, rng, st.tag, user, conversation, turn, SERVER_NAME)
        rec.kill_at = None  # nothing to drop: there is no connection
        assert chat.content is not None
        message = {"role": "user", "content": chat.content}
        request = GenerationRequest(
            key=chat.id,
            messages=[*history, message],
            params=params_from_payload(chat.params.to_wire()),
            session=session,
            user=f"{st.tag}-{user}",  # each simulated user its own, as each connection's owner is served
        )
        rec.sent_at = st.now()
        text = await driver.generate(rec, request)
        st.finish(rec)
        if not rec.ok:
            return
        history += [message, {"role": "assistant", "content": text}]


async def run_engine_only(state: RunState, engine: Any) -> LoadResult:
    """Drive ``engine`` with ``state.cfg``'s workload (closed loop, or open loop with ``--rate``)."""
    cfg = state.cfg
    started = time.time()
    driver = EngineDriver(engine, state)
    driver.start()
    try:
        state.saw_server(SERVER_NAME)
        state.restart_clock()
        await drive(state, lambda user, conversation: _conversation(driver, user, conversation))
    finally:
        engine.stop()
    ends = [r.done_at for r in state.records if r.done_at is not None]
    return LoadResult(
        cfg=cfg,
        started=started,
        window_s=max(ends) if ends else state.now(),
        issued=state.issued,
        records=state.records,
        wire=state.wire,
        buckets=state.buckets,
        idle=None,
        servers=sorted(state.servers),
        arrival_lags=state.arrival_lags,
    )
