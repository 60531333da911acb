"""The engine's interface to the rest of the server: what goes in, what comes out, once per step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from server.defaults import (  # one set of defaults for every door (server/defaults.py)
    ANONYMOUS_HTTP_OWNER,
    DEFAULT_FREQUENCY_PENALTY,
    DEFAULT_MAX_TOKENS,
    DEFAULT_REPETITION_PENALTY,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
)

__all__ = [
    "DEFAULT_FREQUENCY_PENALTY",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_REPETITION_PENALTY",
    "DEFAULT_TEMPERATURE",
    "DEFAULT_TOP_P",
]


# Owners that stand for many callers (none given, or every keyless HTTP caller): the engine treats their
# requests as strangers to each other, sharing only the public prefix of their prompts (scheduler.py).
POOLED_OWNERS = frozenset({"", ANONYMOUS_HTTP_OWNER})
# Which sequences may copy each other's prompt starts (``--prompt-sharing``; scheduler._find_donor):
# "public": across users only the chat template's own opening, any common start within one user's
# requests; "tenant": any common start across users too (every caller one tenant: a caller can time
# whether another's prompt starts like theirs); "off": none (a session's own prefix is still reused).
PROMPT_SHARING = ("public", "tenant", "off")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    top_k: int = 0  # 0: off
    seed: int = 0
    stop: tuple[str, ...] = ()
    repetition_penalty: float = 1.0  # 1.0: off (penalties.py); the server's default is applied by the worker
    frequency_penalty: float = 0.0  # 0: off
    presence_penalty: float = 0.0  # 0: off
    ignore_eos: bool = False  # benchmarks only: every request does its full max_tokens


@dataclass(slots=True)
class GenerationRequest:
    """One generation. ``messages`` go through the model's chat template; ``prompt_ids`` bypass it.

    ``resume_ids`` are tokens already generated (and logged) by an earlier run of the same request: the
    engine re-reads them with the prompt and continues after them, emitting from offset len(resume_ids).
    ``session`` (optional) lets an engine reuse the KV cache of the session's previous turn.
    """

    key: str
    messages: list[dict[str, str]] = field(default_factory=list)
    params: SamplingParams = field(default_factory=SamplingParams)
    prompt_ids: list[int] | None = None
    resume_ids: Sequence[int] = ()
    session: str = ""  # the chat session: an engine with prefix reuse keeps its KV between turns
    user: str = ""  # whose request (the owner): the batching engine shares itself fairly among users
    weight: float = 1.0  # the user's fair-share weight (JWT tier): 2 gets twice the service of 1
    # The caller's prompt_cache_key (OpenAI's; its ``user`` when it sent none): within a pooled owner
    # (POOLED_OWNERS, strangers to each other) the requests with one key are one caller for prompt reuse.
    cache_key: str = ""


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one step produced for one request: ``n`` tokens from ``offset`` whose text is ``text``.

    ``n`` may be 0 (nothing new this step, only a finish). ``finish`` is set on the request's last output:
    "stop" (EOS or a stop string), "length" (max_tokens or the context window; ``length_reason`` says
    which: "max_tokens" or "context"), "error" (with ``error_code``/``error_message``).
    Cancelled requests produce no output: whoever cancelled has already ended the log.
    ``cached_tokens`` is how many of the ``prompt_tokens`` were not computed for this request: their KV
    was copied from its session's cached prefix or another sequence's prompt start (OpenAI's
    ``cached_tokens``; 0 from engines that reuse nothing).
    """

    key: str
    offset: int
    n: int
    text: str
    token_ids: tuple[int, ...] = ()
    finish: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error_code: str = ""
    error_message: str = ""
    length_reason: str = ""  # with finish "length" only: LENGTH_REASONS, else ""


# Why a request ended "length" (SPEC 12, done.length_reason): its max_tokens, or the model's context
# window full, which a larger max_tokens would not help (the client starts a new conversation instead).
LENGTH_REASONS = ("max_tokens", "context")


def length_reason(finish: str | None, *, context_full: bool) -> str:
    """``StepOutput.length_reason`` for an output that ends with ``finish``: when both limits are hit at
    once it is "context", since a retry asking for more tokens would get none."""
    if finish != "length":
        return ""
    return "context" if context_full else "max_tokens"


def resumed_at_end(
    key: str, start: int, n_prompt: int, max_tokens: int, max_context: int
) -> StepOutput | None:
    """The end of a request resumed with ``start`` tokens logged and nothing left to generate (its
    max_tokens reached, or its prompt and those tokens already fill the context window), which a worker
    that died between its last token and its end leaves; None when there is room for more."""
    context_full = n_prompt + start >= max_context
    if start < max_tokens and not context_full:
        return None
    why = length_reason("length", context_full=context_full)
    return StepOutput(key, start, 0, "", finish="length", prompt_tokens=n_prompt, length_reason=why)


StepCallback = Callable[[list[StepOutput]], None]


class EngineOverloaded(Exception):
    """Raised by ``submit`` of an engine with a bounded waiting queue when that queue is full: the
    request was not taken; refuse it with ``overloaded`` and ``retry_after_ms``."""

    def __init__(self, retry_after_ms: int) -> None:
        super().__init__(f"engine overloaded; retry after {retry_after_ms} ms")
        self.retry_after_ms = retry_after_ms


class Engine(Protocol):
    """An engine runs on its own thread and calls ``on_step`` (from that thread) once per step with the
    outputs of every request that produced something in that step."""

    def start(self, on_step: StepCallback) -> None: ...

    def submit(self, request: GenerationRequest) -> None: ...

    def cancel(self, key: str) -> None: ...

    def stop(self) -> None: ...
