"""Fitting without tokenising what cannot fit (prompt.py, issue 24's flood): a message too long to fit is
refused, and an old turn too long for what is left dropped, from a bound on its token count alone; the
bound is sound, so fitting returns exactly what it returned before, where tokenising decided."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.bench.tiny_model import build_tokenizer
from server.engine import prompt
from server.engine.model import ModelNotFound, default_model_dir
from server.engine.prompt import ChatPrompter, PromptTooLarge

HUGE = 900_000  # the flood's message: under the 1 MiB frame limit
PIECES = ["y", " ", "\n", "#", "0", "ab", "é", "東京", "🚀", "<|im_start|>", "\x04", "the quick brown fox "]


@pytest.fixture(scope="module")
def tiny_tok() -> Any:
    return build_tokenizer()


@pytest.fixture(scope="module")
def smol_tok() -> Any:
    from transformers import AutoTokenizer

    try:
        path = default_model_dir()
    except ModelNotFound as exc:
        pytest.skip(str(exc))
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


_PROMPTERS: dict[int, ChatPrompter] = {}


def _prompter(tok: Any) -> ChatPrompter:
    """One prompter per (module-scoped) tokenizer, for the property tests' many examples."""
    if id(tok) not in _PROMPTERS:
        _PROMPTERS[id(tok)] = ChatPrompter.for_tokenizer(tok)
    return _PROMPTERS[id(tok)]


def _words(chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at"]
    out: list[str] = []
    size = 0
    while size < chars:
        out.append(rng.choice(words))
        size += len(out[-1]) + 1
    return " ".join(out)[:chars]


def _fit_before(p: ChatPrompter, messages: list[dict[str, str]], budget: int) -> list[int]:
    """``ChatPrompter.fit`` as it was before this change (main at d83cadd), verbatim but for ``p.``."""
    if not messages:
        return p.encode(messages)
    last = len(messages) - 1
    required = [i for i, m in enumerate(messages) if i == last or m.get("role") == "system"]
    if p.max_token_chars:
        chars = sum(len(messages[i]["content"]) for i in required)
        least = -(-chars // p.max_token_chars)
        if least > budget:
            raise PromptTooLarge("too large by length")
    content: dict[int, list[int]] = dict(
        zip(required, p.encode_text([messages[i]["content"] for i in required]), strict=True)
    )
    markup = p.encode_markup(p._segments(messages))
    head = len(markup[-1])
    cost = {i: len(markup[i]) for i in range(len(messages))}
    used = head + sum(cost[i] + len(content[i]) for i in required)
    if used > budget:
        raise PromptTooLarge("too large")
    kept = set(required)
    for i in range(last - 1, -1, -1):
        if i in kept:
            continue
        left = budget - used - cost[i]
        if p.max_token_chars and len(messages[i]["content"]) > left * p.max_token_chars:
            break
        ids = p.encode_text([messages[i]["content"]])[0]
        if len(ids) > left:
            break
        content[i] = ids
        used += cost[i] + len(ids)
        kept.add(i)
    order = sorted(kept)
    while True:
        msgs = [messages[i] for i in order]
        ids = p._assemble(msgs, [content[i] for i in order])
        if len(ids) <= budget:
            return ids
        optional = [i for i in order if i not in required]
        if not optional:
            raise PromptTooLarge("too large")
        order.remove(optional[0])


def _outcome(fit: Callable[[], list[int]]) -> list[int] | str:
    try:
        return fit()
    except PromptTooLarge:
        return "too_large"


class Spy:
    """An encoder that records the length of every text it is given."""

    def __init__(self, inner: Callable[[list[str]], list[list[int]]]) -> None:
        self.inner = inner
        self.lengths: list[int] = []

    def __call__(self, texts: list[str]) -> list[list[int]]:
        self.lengths.extend(len(t) for t in texts)
        return self.inner(texts)


def _spied(tok: Any) -> tuple[ChatPrompter, Spy, Spy]:
    p = ChatPrompter.for_tokenizer(tok)
    text, markup = Spy(p.encode_text), Spy(p.encode_markup)
    p.encode_text, p.encode_markup = text, markup
    return p, text, markup


texts = st.builds(
    lambda piece, n: piece * n,
    st.sampled_from(PIECES) | st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=12),
    st.integers(1, 10) | st.integers(1, 600),  # mostly short turns, some long
)
conversations = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": texts}),
    min_size=1,
    max_size=7,
)


@pytest.mark.parametrize("fine_from", [prompt.FINE_BOUND_CHARS, 1])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msgs=conversations, budget=st.integers(0, 3000))
def test_fit_returns_what_it_did_before_on_random_conversations(
    tiny_tok: Any, fine_from: int, msgs: list[dict[str, str]], budget: int
) -> None:
    p = _prompter(tiny_tok)
    unbounded = ChatPrompter(p.render, p.encode_text, p.encode_markup)  # every content tokenised
    with mock.patch.object(prompt, "FINE_BOUND_CHARS", fine_from):  # 1: the byte bound on every text
        now = _outcome(lambda: p.fit(msgs, budget))
    assert now == _outcome(lambda: _fit_before(p, msgs, budget))
    # The tiny tokenizer has a token for every byte: the length cap is a bound too, so nothing differs
    # from tokenising everything.
    assert now == _outcome(lambda: unbounded.fit(msgs, budget))


@pytest.mark.parametrize("which", ["tiny_tok", "smol_tok"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts | st.text(st.characters(exclude_categories=("Cs",)), max_size=400))
def test_the_byte_bound_is_never_more_than_the_tokens(
    which: str, text: str, request: pytest.FixtureRequest
) -> None:
    p = _prompter(request.getfixturevalue(which))
    assert p.byte_bound is not None
    assert p.byte_bound.least(text) <= len(p.encode_text([text])[0])


@pytest.mark.parametrize("which", ["tiny_tok", "smol_tok"])
def test_the_byte_bound_holds_on_texts_made_of_the_longest_tokens(
    which: str, request: pytest.FixtureRequest
) -> None:
    """The bound's worst case: a text that is a run of one long token (its 300 longest ones)."""
    tok = request.getfixturevalue(which)
    p = ChatPrompter.for_tokenizer(tok)
    assert p.byte_bound is not None
    vocab = tok.backend_tokenizer.get_vocab(with_added_tokens=False)
    longest = sorted(vocab, key=len, reverse=True)[:300]
    for piece in longest:
        text = tok.backend_tokenizer.decode([vocab[piece]], skip_special_tokens=False) * 7
        assert p.byte_bound.least(text) <= len(p.encode_text([text])[0]), repr(text)


@pytest.mark.parametrize("which", ["tiny_tok", "smol_tok"])
@pytest.mark.parametrize("kind", ["one word", "ordinary words"])
@pytest.mark.parametrize("budget", [2047, 8191])
def test_a_900k_character_message_is_refused_without_tokenising_it(
    which: str, kind: str, budget: int, request: pytest.FixtureRequest
) -> None:
    p, text, markup = _spied(request.getfixturevalue(which))
    huge = "y" * HUGE if kind == "one word" else _words(HUGE)
    with pytest.raises(PromptTooLarge):
        p.fit([{"role": "system", "content": "Be brief."}, {"role": "user", "content": huge}], budget)
    assert max(text.lengths + markup.lengths, default=0) < 1000  # the huge text went to neither encoder


def test_a_message_under_the_length_cap_is_refused_by_its_bytes_untokenised(smol_tok: Any) -> None:
    """400,000 characters are under SmolLM2's length cap at 8191 tokens (81 characters a token), so the
    code before tokenised them (about 0.2 s each) to refuse them; the byte bound refuses them first."""
    p, text, _ = _spied(smol_tok)
    for huge in ("y" * 400_000, _words(400_000)):
        assert p.max_token_chars is not None and len(huge) <= 8191 * p.max_token_chars
        with pytest.raises(PromptTooLarge):
            p.fit([{"role": "user", "content": huge}], 8191)
    assert text.lengths == []


@pytest.mark.parametrize("which", ["tiny_tok", "smol_tok"])
def test_a_long_old_turn_is_dropped_untokenised_and_the_rest_fitted_as_before(
    which: str, request: pytest.FixtureRequest
) -> None:
    p, text, _ = _spied(request.getfixturevalue(which))
    budget = 1500
    assert p.max_token_chars is not None
    long = "y" * (budget * p.max_token_chars - 100)  # under the length cap
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": long},
        {"role": "assistant", "content": "that was long"},
        {"role": "user", "content": "and now?"},
    ]
    ids = p.fit(msgs, budget)
    assert max(text.lengths) < 1000  # the long turn was never tokenised
    assert ids == _fit_before(p, msgs, budget)
    assert ids == p.encode([msgs[0], msgs[4], msgs[5]])  # it, and the turns before it, dropped


def test_characters_smollm2_yields_no_token_for_weigh_nothing(smol_tok: Any) -> None:
    """SmolLM2 has no token for six control characters (0x04, 0x06, 0x13, 0x14, 0x16, 0x1d): a text of
    them is no tokens, and the byte bound says 0 for it, where the length cap says more."""
    p = ChatPrompter.for_tokenizer(smol_tok)
    assert p.byte_bound is not None
    for ch in "\x04\x06\x13\x14\x16\x1d":
        assert p.encode_text([ch * 5000]) == [[]]
        assert p.byte_bound.least(ch * 5000) == 0
    # Under the cap such a prompt is tokenised and fits; over it, it is refused untokenised as before.
    msgs = [{"role": "user", "content": "\x04" * 10_000}]
    assert p.fit(msgs, 200) == _fit_before(p, msgs, 200)
    msgs = [{"role": "user", "content": "\x04" * (200 * 81 + 1)}]
    with pytest.raises(PromptTooLarge):
        p.fit(msgs, 200)


BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def _byte_level_spec(**change: Any) -> dict[str, Any]:
    spec: dict[str, Any] = json.loads(build_tokenizer().backend_tokenizer.to_str())
    spec.update(change)
    return spec


@pytest.mark.parametrize(
    "change",
    [
        {"normalizer": {"type": "NFC"}},  # composing shortens the bytes
        {"normalizer": {"type": "Lowercase"}},
        {"truncation": {"max_length": 8, "strategy": "LongestFirst", "stride": 0, "direction": "Right"}},
        {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "WhitespaceSplit"}, BYTE_LEVEL]}},
        {"pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always"}},
        {
            "added_tokens": [
                {
                    "id": 9,
                    "content": "x",
                    "single_word": False,
                    "lstrip": True,
                    "rstrip": False,
                    "normalized": False,
                    "special": False,
                }
            ]
        },
    ],
    ids=["nfc", "lowercase", "truncation", "whitespace-split", "metaspace", "lstrip-added-token"],
)
def test_no_byte_bound_where_it_would_not_hold(change: dict[str, Any]) -> None:
    assert prompt._byte_bound(_byte_level_spec()) is not None
    assert prompt._byte_bound(_byte_level_spec(**change)) is None


def test_no_byte_bound_for_a_wordpiece_tokenizer() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##a": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert prompt._byte_bound(json.loads(tok.to_str())) is None
    # Why: a word longer than WordPiece's limit is one unknown token, however long.
    assert len(tok.encode("a" * 5000).ids) == 1


def test_the_bounds_are_computed_once_per_tokenizer(tiny_tok: Any) -> None:
    first, second = ChatPrompter.for_tokenizer(tiny_tok), ChatPrompter.for_tokenizer(tiny_tok)
    assert first.byte_bound is not None and first.byte_bound is second.byte_bound
    with mock.patch.object(prompt, "_byte_bound", side_effect=AssertionError("computed again")):
        ChatPrompter.for_tokenizer(tiny_tok)
