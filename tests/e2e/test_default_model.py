"""The default sampling settings on the real default model (SmolLM2-135M-Instruct): without a repetition
penalty its replies fall into loops (a line repeated until max_tokens) even at temperature 0.2; with the
server's defaults they do not. Seeds fix the samples, so the test sees the same replies every run."""

from __future__ import annotations

import collections
import queue
import re

import pytest

from server.defaults import DEFAULT_REPETITION_PENALTY
from server.engine.api import GenerationRequest, StepOutput
from server.engine.engine import BatchingEngine
from server.engine.model import LoadedModel, load_model
from server.worker.loop import params_from_payload

PROMPT = "Write a short poem about the sea."
SEEDS = (0, 1, 2)


def longest_repeat(text: str) -> int:
    """How often the most repeated line or sentence (over 10 characters) occurs in ``text``."""
    parts = [s.strip() for s in re.split(r"[.!?\n]+", text) if len(s.strip()) > 10]
    return max(collections.Counter(parts).values(), default=0)


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model(None, device="cpu")


def replies(m: LoadedModel, payload: dict[str, object]) -> list[str]:
    """The replies to PROMPT for SEEDS with ``params`` as a chat would send them (the worker's defaults
    fill in the rest, exactly as for a chat from any client)."""
    outs: queue.Queue[list[StepOutput]] = queue.Queue()
    engine = BatchingEngine(m)
    engine.start(outs.put)
    text = {f"s{seed}": "" for seed in SEEDS}
    try:
        for seed in SEEDS:
            sp = params_from_payload({**payload, "seed": seed})
            engine.submit(GenerationRequest(f"s{seed}", [{"role": "user", "content": PROMPT}], sp))
        pending = set(text)
        while pending:
            for o in outs.get(timeout=300):
                text[o.key] += o.text
                if o.finish:
                    pending.discard(o.key)
    finally:
        engine.stop()
    return list(text.values())


def test_default_params_stop_the_default_models_loops(smollm2: LoadedModel) -> None:
    assert DEFAULT_REPETITION_PENALTY > 1.0
    looping = replies(smollm2, {"repetition_penalty": 1.0})
    # Not vacuous: without the penalty these very samples loop.
    assert max(longest_repeat(t) for t in looping) >= 5, looping
    defaults = replies(smollm2, {})
    assert params_from_payload({}).temperature == 0.2
    for t in defaults:
        assert longest_repeat(t) < 3, t
        assert len(t) > 40, t  # an answer, not an early stop
