"""The one set of sampling defaults: what a chat that leaves a parameter out gets from the worker, what
``tokenwire chat`` shows as the server's default, and what the browser UI fills its settings with (served
in ``/config.json``). Change them here and every door agrees.

Chosen by ``tokenwire eval`` (server/eval/: 41 prompts with a check a program runs, a grid of sampling
settings, the best pass rate among settings whose replies loop at most 2% of the time), on the default
SmolLM2-135M-Instruct; BENCHMARKS.md's "Sampling defaults" section has the table of the run. There,
greedy decoding with a frequency penalty of 0.3 passed 53.7% with no loop; the defaults before it
(temperature 0.2, top-p 0.9, repetition penalty 1.2) passed 26.0% (24.4% in an earlier run: sampled
settings move by a few points between runs, greedy ones not at all). The repetition penalty divides the
logit of every token in the prompt too (the chat template's end-of-turn token included), so at 1.2 the
model rambled to max_tokens on over a third of its replies; the frequency penalty counts only the reply's own
tokens. Plain greedy passed about as often but looped on 3 of its 41 replies.

The top-p default only matters to a client that raises the temperature: it is what SmolLM2's model card
recommends. Run ``tokenwire eval`` again for another model (``--model``) and set these from its table."""

from __future__ import annotations

DEFAULT_MAX_TOKENS = 256
DEFAULT_TEMPERATURE = 0.0  # greedy
DEFAULT_TOP_P = 0.9
DEFAULT_REPETITION_PENALTY = 1.0  # off
DEFAULT_FREQUENCY_PENALTY = 0.3

# The owner of every HTTP request made without a bearer token while auth is off: many callers, one name
# (the gateway names it; the engine shares no prompt start between its requests: engine/api.POOLED_OWNERS).
ANONYMOUS_HTTP_OWNER = "http:anonymous"


def sampling_defaults() -> dict[str, float | int]:
    """The defaults as ``params`` keys (SPEC 4.2)."""
    return {
        "temperature": DEFAULT_TEMPERATURE,
        "top_p": DEFAULT_TOP_P,
        "max_tokens": DEFAULT_MAX_TOKENS,
        "repetition_penalty": DEFAULT_REPETITION_PENALTY,
        "frequency_penalty": DEFAULT_FREQUENCY_PENALTY,
    }
