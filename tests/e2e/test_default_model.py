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


def replies(m: LoadedModel, payloads: dict[str, dict[str, object]]) -> dict[str, list[str]]:
    """The replies to PROMPT for SEEDS under each named ``params`` payload, as a chat would send it (the
    worker's defaults fill in the rest, exactly as for a chat from any client); one batch for all."""
    outs: queue.Queue[list[StepOutput]] = queue.Queue()
    engine = BatchingEngine(m)
    engine.start(outs.put)
    text = {(name, seed): "" for name in payloads for seed in SEEDS}
    keys = {f"{name}:{seed}": (name, seed) for name, seed in text}
    try:
        for key, (name, seed) in keys.items():
            sp = params_from_payload({**payloads[name], "seed": seed})
            engine.submit(GenerationRequest(key, [{"role": "user", "content": PROMPT}], sp))
        pending = set(keys)
        while pending:
            for o in outs.get(timeout=600):
                text[keys[o.key]] += o.text
                if o.finish:
                    pending.discard(o.key)
    finally:
        engine.stop()
    return {name: [text[name, seed] for seed in SEEDS] for name in payloads}


@pytest.mark.timeout(900)  # 6 replies of 256 tokens from the real model on a CPU
def test_default_params_stop_the_default_models_loops(smollm2: LoadedModel) -> None:
    assert DEFAULT_REPETITION_PENALTY > 1.0
    got = replies(smollm2, {"no_penalty": {"repetition_penalty": 1.0}, "defaults": {}})
    # Not vacuous: without the penalty these very samples loop.
    assert max(longest_repeat(t) for t in got["no_penalty"]) >= 5, got["no_penalty"]
    assert params_from_payload({}).temperature == 0.2
    for t in got["defaults"]:
        assert longest_repeat(t) < 3, t
        assert len(t) > 40, t  # an answer, not an early stop
