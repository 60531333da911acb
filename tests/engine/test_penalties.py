"""Repetition, frequency and presence penalties: the formulas on logits, the rows they touch, the wire
validation, and the engine path against transformers' own repetition penalty (greedy, so the tokens
must match exactly)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from protocol import Params, ProtocolError
from protocol.frames import parse_client_frame
from server.defaults import DEFAULT_FREQUENCY_PENALTY, DEFAULT_REPETITION_PENALTY
from server.engine.api import GenerationRequest, SamplingParams
from server.engine.model import LoadedModel, load_model
from server.engine.penalties import apply_penalties
from server.worker.loop import params_from_payload
from tests.engine.test_batching_engine import engine, msg, run_all


def test_no_penalty_leaves_the_logits_alone() -> None:
    logits = torch.randn(2, 10)
    before = logits.clone()
    out = apply_penalties(logits, [SamplingParams(), SamplingParams()], [[1, 2], [3]], [1, 1])
    assert out is logits and torch.equal(out, before)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0, 0.5]])
    out = apply_penalties(logits.clone(), [SamplingParams(repetition_penalty=2.0)], [[0, 1, 1]], [1])
    # Tokens 0 and 1 were seen (prompt or reply, any number of times); 2, 3 and 4 were not.
    assert out.tolist() == [[1.0, -4.0, 3.0, -1.0, 0.5]]


def test_frequency_and_presence_count_only_the_reply() -> None:
    logits = torch.zeros(1, 6)
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    # Prompt [4, 4, 5]; reply [1, 2, 2, 2]: token 4 and 5 appear only in the prompt.
    out = apply_penalties(logits, [p], [[4, 4, 5, 1, 2, 2, 2]], [3])
    assert out.tolist() == [[0.0, -1.5, -2.5, 0.0, 0.0, 0.0]]


def _dense_reference(
    logits: torch.Tensor, params: list[SamplingParams], tokens: list[list[int]], n_prompt: list[int]
) -> torch.Tensor:
    """The formulas over whole [rows, vocab] tables, as apply_penalties computed them before it went
    sparse: the sparse one must give the very same floats."""
    vocab = logits.shape[-1]
    for i, p in enumerate(params):
        seen = sorted({t for t in tokens[i] if 0 <= t < vocab})
        if p.repetition_penalty != 1.0 and seen:
            vals = logits[i, seen]
            pen = torch.tensor(p.repetition_penalty, dtype=logits.dtype)
            logits[i, seen] = torch.where(vals > 0, vals / pen, vals * pen)
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            counts = torch.zeros(vocab, dtype=logits.dtype)
            for t in tokens[i][n_prompt[i] :]:
                if 0 <= t < vocab:
                    counts[t] += 1
            f = torch.tensor(p.frequency_penalty, dtype=logits.dtype)
            pres = torch.tensor(p.presence_penalty, dtype=logits.dtype)
            logits[i] -= counts * f + (counts > 0).to(logits.dtype) * pres
    return logits


def test_sparse_penalties_equal_the_dense_formulas_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(7)

    def pick(options: list[float]) -> float:
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    for _case in range(60):
        rows, vocab = int(torch.randint(1, 9, (1,), generator=gen)), 64
        logits = torch.randn(rows, vocab, generator=gen) * 5
        params, tokens, n_prompt = [], [], []
        for _ in range(rows):
            params.append(
                SamplingParams(
                    repetition_penalty=pick([1.0, 1.0, 1.2, 0.8]),
                    frequency_penalty=pick([0.0, 0.3, -0.7, 1.9]),
                    presence_penalty=pick([0.0, 0.0, 0.5, -1.25]),
                )
            )
            n = int(torch.randint(0, 12, (1,), generator=gen))
            # Repeats (few distinct ids), the odd id out of the vocabulary, an empty reply now and then.
            seq = torch.randint(
                -2, vocab + 2, (n + int(torch.randint(0, 20, (1,), generator=gen)),), generator=gen
            )
            tokens.append([int(x) for x in seq % 20] if _case % 3 else [int(x) for x in seq])
            n_prompt.append(n)
        want = _dense_reference(logits.clone(), params, tokens, n_prompt)
        got = apply_penalties(logits.clone(), params, tokens, n_prompt)
        assert torch.equal(got, want), _case


def test_only_rows_that_ask_are_touched_and_inference_tensors_are_fine() -> None:
    with torch.inference_mode():  # the runner's logits come out of inference mode
        logits = torch.ones(3, 4)
    out = apply_penalties(
        logits,
        [SamplingParams(), SamplingParams(repetition_penalty=2.0), SamplingParams()],
        [[0], [0], [0]],
        [1, 1, 1],
    )
    assert out.tolist() == [[1.0] * 4, [0.5, 1.0, 1.0, 1.0], [1.0] * 4]


@pytest.mark.parametrize(
    ("params", "error"),
    [
        ({"repetition_penalty": 0}, "params.repetition_penalty: expected a number in (0, 2], got 0"),
        ({"repetition_penalty": 2.5}, "params.repetition_penalty"),
        ({"repetition_penalty": "1.1"}, "params.repetition_penalty: expected a finite number, got string"),
        ({"frequency_penalty": -2.1}, "params.frequency_penalty: expected a number in [-2, 2], got -2.1"),
        ({"presence_penalty": 3}, "params.presence_penalty"),
        (
            {"presence_penalty": 2.0000001},
            "params.presence_penalty: expected a number in [-2, 2], got 2.0000001",
        ),
    ],
)
def test_out_of_range_penalties_are_bad_frames(params: dict[str, object], error: str) -> None:
    with pytest.raises(ProtocolError) as exc:
        parse_client_frame({"type": "chat", "id": "a", "content": "hi", "params": params})
    assert error in str(exc.value)


def test_penalties_travel_from_the_wire_to_the_engine() -> None:
    chat = parse_client_frame(
        {
            "type": "chat",
            "id": "a",
            "content": "hi",
            "params": {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": -0.25},
        }
    )
    assert chat.params == Params(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=-0.25)  # type: ignore[union-attr]
    sp = params_from_payload(chat.params.to_wire())  # type: ignore[union-attr]
    assert (sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty) == (1.3, 0.5, -0.25)
    defaults = params_from_payload({})  # the server's defaults fill what a chat leaves out
    assert (defaults.repetition_penalty, defaults.frequency_penalty) == (
        DEFAULT_REPETITION_PENALTY,
        DEFAULT_FREQUENCY_PENALTY,
    )


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> LoadedModel:
    return load_model(tiny_model_dir)


RP = 10.0  # strong: the tiny random model's greedy reply repeats one token until the penalty is this high


def test_engine_repetition_penalty_matches_transformers(tiny: LoadedModel) -> None:
    prompts = ["Hello", "The capital of France"]
    n = 24
    reqs = [
        GenerationRequest(f"p{i}", msg(p), SamplingParams(max_tokens=n, temperature=0, repetition_penalty=RP))
        for i, p in enumerate(prompts)
    ]
    plain = GenerationRequest("plain", msg("Hello"), SamplingParams(max_tokens=n, temperature=0))
    outs, _ = run_all(engine(tiny), [*reqs, plain])
    for r in reqs:
        prompt = torch.tensor([tiny.encode_chat(r.messages)])
        ref = tiny.model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=n,
            do_sample=False,
            repetition_penalty=RP,
        )[0, prompt.shape[1] :].tolist()
        eos = next((i for i, t in enumerate(ref) if t in tiny.eos_ids), None)
        ref = ref if eos is None else ref[: eos + 1]
        assert [t for o in outs[r.key] for t in o.token_ids] == ref
    # Batch mates without a penalty are unaffected, and the penalty changes the greedy reply (the tiny
    # model's greedy reply repeats one token).
    plain_ids = [t for o in outs["plain"] for t in o.token_ids]
    penalised = [t for o in outs["p0"] for t in o.token_ids]
    assert len(set(penalised)) > len(set(plain_ids))


@pytest.mark.parametrize("penalty", [1e-300, 5e-324, 1e-30])
def test_a_repetition_penalty_near_zero_leaves_the_logits_finite(penalty: float) -> None:
    # SPEC allows any repetition_penalty in (0, 2]; a seen token's positive logit divided by one that is 0
    # in float32 was +inf, and the softmax then NaN. Capped, the seen tokens win, as the formula says.
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5, 4.0, -torch.inf]])
    params = [SamplingParams(temperature=1.0, repetition_penalty=penalty, seed=1)]
    out = apply_penalties(logits, params, [[0, 1, 2, 5]], [4])
    assert bool(torch.isfinite(out[0, :5]).all()) and out[0, 5] == -torch.inf  # a masked token stays so
    assert out[0, 0] > out[0, 4] and out[0, 2] > out[0, 4] and out[0, 1] <= 0  # seen positives first
    from server.engine.sampling import sample

    assert sample(out, params, [0])[0] in (0, 2)
    assert sample(out, [SamplingParams(temperature=0.0, repetition_penalty=penalty)], [0])[0] in (0, 2)
