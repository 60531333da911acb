"""The default sampling settings on the real default model (SmolLM2-135M-Instruct). Greedy decoding
without a penalty falls into a loop on prompts like these (a phrase repeated until max_tokens, then fed
back as history); the server's defaults (greedy with a frequency penalty, chosen by ``tokenwire eval``)
do not, and still stop on their own. Greedy replies are the same every run."""

from __future__ import annotations

import collections
import queue
import re

import pytest

from server.engine.api import GenerationRequest, StepOutput
from server.engine.engine import BatchingEngine
from server.engine.model import LoadedModel, load_model
from server.worker.loop import params_from_payload

# Prompts the eval's first grid saw plain greedy decoding loop on (server/eval/cases.py).
PROMPTS = (
    "Who wrote Romeo and Juliet?",
    "What is the capital of Italy? Write your whole answer in capital letters.",
    "Write a short poem about the sea.",
)


def longest_repeat(text: str) -> int:
    """How often the most repeated line, sentence or 4-word phrase occurs in ``text``: a loop repeats
    one of these over and over."""
    parts = [s.strip() for s in re.split(r"[.!?\n]+", text) if len(s.strip()) > 10]
    words = text.split()
    grams = [" ".join(words[i : i + 4]) for i in range(len(words) - 3)]
    return max(
        max(collections.Counter(parts).values(), default=0),
        max(collections.Counter(grams).values(), default=0),
    )


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model(None, device="cpu", dtype="float32")  # the exact greedy replies: float32 anywhere


def replies(m: LoadedModel, payloads: dict[str, dict[str, object]]) -> dict[str, list[str]]:
    """The replies to PROMPTS under each named ``params`` payload, as a chat would send it (the worker's
    defaults fill in the rest, exactly as for a chat from any client); one batch for all."""
    outs: queue.Queue[list[StepOutput]] = queue.Queue()
    engine = BatchingEngine(m)
    engine.start(outs.put)
    text = {(name, i): "" for name in payloads for i in range(len(PROMPTS))}
    keys = {f"{name}:{i}": (name, i) for name, i in text}
    finish: dict[tuple[str, int], str] = {}
    try:
        for key, (name, i) in keys.items():
            sp = params_from_payload(payloads[name])
            engine.submit(GenerationRequest(key, [{"role": "user", "content": PROMPTS[i]}], sp))
        pending = set(keys)
        while pending:
            for o in outs.get(timeout=600):
                text[keys[o.key]] += o.text
                if o.finish:
                    finish[keys[o.key]] = o.finish
                    pending.discard(o.key)
    finally:
        engine.stop()
    return {name: [f"{finish[name, i]}|{text[name, i]}" for i in range(len(PROMPTS))] for name in payloads}


@pytest.mark.timeout(900)  # 6 replies of up to 256 tokens from the real model on a CPU
def test_default_params_stop_the_default_models_loops(smollm2: LoadedModel) -> None:
    defaults = params_from_payload({})
    assert defaults.temperature == 0.0 and defaults.frequency_penalty > 0.0
    got = replies(smollm2, {"plain_greedy": {"temperature": 0.0, "frequency_penalty": 0.0}, "defaults": {}})
    # Not vacuous: without the penalty these very prompts loop (a phrase 12-70 times here; a reply of
    # the defaults repeats its most frequent phrase at most 3 times).
    assert max(longest_repeat(t) for t in got["plain_greedy"]) >= 10, got["plain_greedy"]
    for t in got["defaults"]:
        text = t.partition("|")[2]
        assert longest_repeat(text) <= 4, t
        assert len(text) > 10, t  # an answer, not an empty stop
    assert sum(t.startswith("stop|") for t in got["defaults"]) >= 2, got["defaults"]  # they end by themselves
