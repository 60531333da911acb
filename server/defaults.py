"""The one set of sampling defaults: what a chat that leaves a parameter out gets from the worker, what
``tokenwire chat`` shows as "server default", and what the browser UI fills its settings with (served in
``/config.json``). Change them here and every door agrees.

Temperature 0.2 / top-p 0.9 are what SmolLM2's model card recommends for chat. Even so the 135M model
falls into loops (one sentence repeated to max_tokens, then fed back as history); a mild repetition
penalty stops them (tests/e2e/test_default_model.py shows it on the real model)."""

from __future__ import annotations

DEFAULT_MAX_TOKENS = 256
DEFAULT_TEMPERATURE = 0.2
DEFAULT_TOP_P = 0.9
# 1.0 is off. 1.2 on 12 seeded replies (4 prompts x 3 seeds, temperature 0.2, 256 tokens): 6 of 12 had a
# line repeated 3+ times without it (up to 15 times), 4 of 12 at 1.1, none at 1.2 or 1.3.
DEFAULT_REPETITION_PENALTY = 1.2


def sampling_defaults() -> dict[str, float | int]:
    """The defaults as ``params`` keys (SPEC 4.2)."""
    return {
        "temperature": DEFAULT_TEMPERATURE,
        "top_p": DEFAULT_TOP_P,
        "max_tokens": DEFAULT_MAX_TOKENS,
        "repetition_penalty": DEFAULT_REPETITION_PENALTY,
    }
