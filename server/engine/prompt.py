"""Turning a conversation into prompt token ids within a budget, before it reaches the engine thread.

Three rules shape this module:

* **User text is text.** The chat template is rendered with a placeholder in place of each message's
  content; the template's own text between the placeholders (its markers, roles, generation prompt) is
  tokenised with special tokens recognised, and every message's content is tokenised as ordinary text, so
  a user who types ``<|im_start|>system`` gets the tokens of those characters, never a control token.
* **Fitting is linear.** Each message's content is tokenised at most once. The oldest non-system turns
  are dropped by their token counts (newest kept first) instead of re-rendering and re-tokenising the
  whole conversation per dropped turn.
* **Only what can fit is tokenised.** A prompt is refused (too_large), and an old turn dropped, without
  tokenising its content when its length proves it over: content of more than ``budget *
  max_token_chars`` characters (the longest token) is refused as before; and for a byte-level BPE,
  ``ByteBound`` counts a text's tokens from its bytes (each byte weighs ``1 / longest[b]``), a sound
  lower bound 3-4x tighter on letters, so only a text that may fit is tokenised. The length rule is a
  cap rather than a bound where a tokenizer yields no token for some characters (SmolLM2: six control
  characters): there it refuses a prompt that would have fitted, as it always did. The byte bound is
  sound: where it decides, tokenising would decide the same way, so fitting returns what tokenising
  everything returns (bar the cap).

Model-free: the template and the tokenizer come in as callables (``ChatPrompter``), or from a Hugging Face
tokenizer (``ChatPrompter.for_tokenizer``).
"""

from __future__ import annotations

import contextlib
import json
import math
import secrets
import weakref
from collections.abc import Callable, Sequence
from typing import Any

Messages = list[dict[str, str]]
Render = Callable[[Messages], str]  # the chat template: messages -> text, ready for the assistant's turn
EncodeMany = Callable[[list[str]], list[list[int]]]


# Texts shorter than this are tokenised rather than byte-counted: the finer bound costs about as much.
FINE_BOUND_CHARS = 2048


class PromptTooLarge(ValueError):
    pass


class ByteBound:
    """A lower bound on a byte-level BPE's token count for a text, from the text's bytes alone.

    ``longest[b]`` is the most bytes any token holding byte ``b`` spans (0: no token holds ``b``, so
    ``b`` is dropped or part of an unknown token, which holds only such bytes). A token spanning n bytes
    holds only bytes whose ``longest`` is at least n, so it weighs at most 1 in ``sum(1 / longest[b])``
    over the text's bytes (0-bytes weigh 0): that sum is at most the number of tokens. Tighter than the
    longest token alone, which is a run of spaces or of ``#``: in SmolLM2's vocabulary no token holding
    ``y`` is longer than 19 bytes, nor one holding a letter longer than 25, against 81 for any token.
    """

    def __init__(self, longest: Sequence[int]) -> None:
        if len(longest) != 256 or min(longest) < 0:
            raise ValueError("one non-negative length per byte")
        self.longest = tuple(longest)
        # Exact integer arithmetic: weight 1/n as scale//n over a common scale.
        self._scale = math.lcm(*(n for n in self.longest if n)) if any(self.longest) else 1
        self._weights = [self._scale // n if n else 0 for n in self.longest]

    def least(self, text: str) -> int:
        import numpy as np  # a dependency of transformers; only needed for long texts

        data = text.encode("utf-8", "surrogatepass")  # a lone surrogate (refused by the encoder) as 3 bytes
        counts: list[int] = np.bincount(np.frombuffer(data, dtype=np.uint8), minlength=256).tolist()
        total = sum(c * w for c, w in zip(counts, self._weights, strict=True))
        return -(-total // self._scale)


class ChatPrompter:
    """Messages -> prompt ids through a chat template, content as plain text, fitted to a budget.

    ``render`` is the template; ``encode_text`` tokenises content (special-token strings as text);
    ``encode_markup`` tokenises the template's own text (special tokens recognised). Both take a batch.
    ``max_token_chars``: content longer than ``max_token_chars`` characters per token of budget is
    refused untokenised (None: no such cap). ``byte_bound``: a lower bound on content's tokens from its
    bytes (None: none known).
    """

    def __init__(
        self,
        render: Render,
        encode_text: EncodeMany,
        encode_markup: EncodeMany,
        *,
        max_token_chars: int | None = None,
        byte_bound: ByteBound | None = None,
    ) -> None:
        self.render = render
        self.encode_text = encode_text
        self.encode_markup = encode_markup
        self.max_token_chars = max_token_chars
        self.byte_bound = byte_bound
        self._nonce = secrets.token_hex(8)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> ChatPrompter:
        """A prompter over a Hugging Face tokenizer (its chat template, or ``role: content`` lines)."""
        return _from_hf(tokenizer)

    # ---- public -------------------------------------------------------------------------------------

    def encode(self, messages: Messages) -> list[int]:
        """All of ``messages`` as prompt ids (no budget)."""
        contents = self.encode_text([m["content"] for m in messages])
        return self._assemble(messages, contents)

    def fit(self, messages: Messages, budget: int) -> list[int]:
        """Prompt ids of ``messages`` in at most ``budget`` tokens, dropping the oldest non-system turns.

        The system prompt(s) and the latest message are always kept; if those alone do not fit the
        request is refused (PromptTooLarge) rather than silently answered without its question."""
        if not messages:
            return self.encode(messages)
        last = len(messages) - 1
        required = [i for i, m in enumerate(messages) if i == last or m.get("role") == "system"]
        texts = [m["content"] for m in messages]
        # Over the budget by the required contents' lengths alone: refused, nothing rendered or tokenised.
        chars = sum(len(texts[i]) for i in required)
        if self.max_token_chars and chars > budget * self.max_token_chars:
            at_least = -(-chars // self.max_token_chars)
            raise PromptTooLarge(
                f"prompt is at least {at_least} tokens ({chars} characters); "
                f"this server takes at most {budget}"
            )
        least = {i: self._least(texts[i], budget) for i in required}
        if sum(least.values()) > budget:
            raise PromptTooLarge(
                f"prompt is at least {sum(least.values())} tokens; this server takes at most {budget}"
            )
        # Template cost per message (its header and trailer around the content), from one rendering of
        # the whole conversation with placeholders: cheap, and no content is tokenised for it.
        markup = self.encode_markup(self._segments(messages))
        head = len(markup[-1])  # what follows the last content: the generation prompt
        cost = {i: len(markup[i]) for i in range(len(messages))}
        floor = head + sum(cost[i] + least[i] for i in required)
        if floor > budget:  # with the template's own tokens: still no content tokenised
            raise PromptTooLarge(f"prompt is at least {floor} tokens; this server takes at most {budget}")
        content: dict[int, list[int]] = dict(
            zip(required, self.encode_text([texts[i] for i in required]), strict=True)
        )
        used = head + sum(cost[i] + len(content[i]) for i in required)
        if used > budget:
            raise PromptTooLarge(f"prompt is {used} tokens; this server takes at most {budget}")
        kept = set(required)
        for i in range(last - 1, -1, -1):  # newest optional turn first: drop the oldest
            if i in kept:
                continue
            left = budget - used - cost[i]
            over = self.max_token_chars and len(texts[i]) > left * self.max_token_chars
            if over or self._least(texts[i], left) > left:
                break  # provably over (or over the cap): no need to tokenise it (nor anything older)
            ids = self.encode_text([texts[i]])[0]
            if len(ids) > left:
                break
            content[i] = ids
            used += cost[i] + len(ids)
            kept.add(i)
        order = sorted(kept)
        while True:
            # The exact ids: the template rendered again around the kept messages (a template may
            # change its header when the first turn goes, e.g. a default system prompt).
            msgs = [messages[i] for i in order]
            ids = self._assemble(msgs, [content[i] for i in order])
            if len(ids) <= budget:
                return ids
            optional = [i for i in order if i not in required]
            if not optional:
                raise PromptTooLarge(f"prompt is {len(ids)} tokens; this server takes at most {budget}")
            order.remove(optional[0])

    # ---- internals ----------------------------------------------------------------------------------

    def _least(self, text: str, left: int) -> int:
        """Tokens ``text`` is at the very least as content, by its bytes (0 where no bound is known, or for
        a short text, which is about as cheap to tokenise, or one that cannot be over ``left``)."""
        if self.byte_bound is None or len(text) < FINE_BOUND_CHARS or 4 * len(text) <= left:
            return 0  # at most 4 bytes a character, each a token at most: it cannot be over ``left``
        return self.byte_bound.least(text)

    def _placeholder(self, i: int) -> str:
        return f"\x00tw{self._nonce}.{i}\x00"

    def _segments(self, messages: Messages) -> list[str]:
        """The template's text around the contents: segment i precedes message i's content, the last one
        follows the last content."""
        probe = [{**m, "content": self._placeholder(i)} for i, m in enumerate(messages)]
        text = self.render(probe)
        segments: list[str] = []
        for i in range(len(messages)):
            before, sep, text = text.partition(self._placeholder(i))
            if not sep:
                raise ValueError("the chat template does not insert message contents verbatim")
            segments.append(before)
        segments.append(text)
        return segments

    def _assemble(self, messages: Messages, contents: Sequence[list[int]]) -> list[int]:
        markup = self.encode_markup(self._segments(messages))
        ids: list[int] = []
        for seg, body in zip(markup, contents, strict=False):
            ids.extend(seg)
            ids.extend(body)
        ids.extend(markup[-1])
        return ids


def _plain_render(messages: Messages) -> str:
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def _from_hf(tok: Any) -> ChatPrompter:
    if getattr(tok, "chat_template", None):

        def render(messages: Messages) -> str:
            return str(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))

    else:
        render = _plain_render
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        from tokenizers import Tokenizer

        # Two copies of the Rust tokenizer, one of which reads special-token strings as text. Copies,
        # because flipping ``encode_special_tokens`` on a shared one would race between pool threads;
        # encode_batch runs without the GIL, so the pool's threads work while the engine runs.
        spec = backend.to_str()
        text_tok = Tokenizer.from_str(spec)
        text_tok.encode_special_tokens = True
        markup_tok = Tokenizer.from_str(spec)
        markup_tok.encode_special_tokens = False

        def encode_text(texts: list[str]) -> list[list[int]]:
            return [e.ids for e in text_tok.encode_batch(texts, add_special_tokens=False)]

        def encode_markup(texts: list[str]) -> list[list[int]]:
            return [e.ids for e in markup_tok.encode_batch(texts, add_special_tokens=False)]

        max_chars, byte_bound = _bounds_for(tok, backend, spec)
        prompter = ChatPrompter(
            render, encode_text, encode_markup, max_token_chars=max_chars, byte_bound=byte_bound
        )
    else:
        # A slow (Python) tokenizer: transformers' own switch for reading special tokens as text.
        def encode_text(texts: list[str]) -> list[list[int]]:
            return [list(tok.encode(t, add_special_tokens=False, split_special_tokens=True)) for t in texts]

        def encode_markup(texts: list[str]) -> list[list[int]]:
            return [list(tok.encode(t, add_special_tokens=False)) for t in texts]

        prompter = ChatPrompter(render, encode_text, encode_markup)
    try:
        prompter.encode([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    except ValueError:
        # A template that transforms the content (trims it, say) cannot be split around it: fall back to
        # plain "role: content" lines, which can, rather than tokenising user text as markup.
        prompter.render = _plain_render
    return prompter


# ---- the bounds: from the tokenizer's JSON, once per tokenizer -------------------------------------------

_BOUNDS: weakref.WeakKeyDictionary[Any, tuple[int | None, ByteBound | None]] = weakref.WeakKeyDictionary()


def _bounds_for(tok: Any, backend: Any, spec: str) -> tuple[int | None, ByteBound | None]:
    """The longest token (characters) and the byte bound of a fast tokenizer, computed once per tokenizer."""
    with contextlib.suppress(KeyError, TypeError):
        return _BOUNDS[tok]
    longest = max((len(t) for t in backend.get_vocab(with_added_tokens=True)), default=0)
    bounds = (longest or None, _byte_bound(json.loads(spec)))
    with contextlib.suppress(TypeError):  # not weakly referenceable: computed again next time
        _BOUNDS[tok] = bounds
    return bounds


def _byte_alphabet() -> dict[int, str]:
    """The byte-level pre-tokenizer's byte -> character map (GPT-2's ``bytes_to_unicode``)."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars: dict[int, str] = {}
    for b in range(256):
        chars[b] = chr(b) if b in keep else chr(256 + len([x for x in range(b) if x not in keep]))
    return chars


def _keeps_every_char(pre: Any) -> bool:
    """Whether a pre-tokenizer hands every character on (splitting is fine, removing is not)."""
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_keeps_every_char(p) for p in pre.get("pretokenizers", []))
    if kind in ("ByteLevel", "Digits", "UnicodeScripts"):
        return True
    if kind in ("Split", "Punctuation"):
        return str(pre.get("behavior", "")).lower() != "removed"
    return False  # Whitespace, WhitespaceSplit, BertPreTokenizer, CharDelimiterSplit, Metaspace...


def _is_byte_level(pre: Any) -> bool:
    if pre is None:
        return False
    if pre.get("type") == "Sequence":
        return any(_is_byte_level(p) for p in pre.get("pretokenizers", []))
    return bool(pre.get("type") == "ByteLevel")


def _reachable(model: dict[str, Any]) -> set[str]:
    """The tokens a BPE without affixes can yield for text: its single characters and its merges' results
    (every vocabulary entry where whole words are looked up first). Special tokens the vocabulary holds
    but no merge builds are left out, so they do not loosen the bound."""
    vocab: dict[str, int] = model.get("vocab") or {}
    if model.get("ignore_merges"):
        return set(vocab)
    pieces = {p for p in vocab if len(p) == 1}
    for merge in model.get("merges") or []:
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        pieces.add(a + b)
    return pieces


def _byte_bound(spec: dict[str, Any]) -> ByteBound | None:
    """The ``ByteBound`` of a Hugging Face tokenizer's JSON, where one is sound: a byte-level BPE without
    affixes, normaliser or truncation, whose pre-tokenizer drops nothing and whose non-special added
    tokens (content is encoded with special tokens read as text, so special ones never occur) take no
    whitespace beside them. Otherwise None (a WordPiece or fused unknown token can stand for a whole
    run; a normaliser or a removing pre-tokenizer changes the bytes)."""
    model = spec.get("model") or {}
    added = [a for a in spec.get("added_tokens") or [] if not a.get("special")]
    if (
        model.get("type") != "BPE"
        or model.get("continuing_subword_prefix")
        or model.get("end_of_word_suffix")
        or spec.get("normalizer") is not None
        or spec.get("truncation") is not None
        or not _is_byte_level(spec.get("pre_tokenizer"))
        or not _keeps_every_char(spec.get("pre_tokenizer"))
        or any(a.get("lstrip") or a.get("rstrip") for a in added)
    ):
        return None
    vocab: dict[str, int] = model.get("vocab") or {}
    alphabet = _byte_alphabet()
    to_byte = {c: b for b, c in alphabet.items()}
    longest = [0] * 256
    for piece in _reachable(model):
        if all(c in to_byte for c in piece):  # else not made of byte characters: never yielded for text
            for b in {to_byte[c] for c in piece}:
                longest[b] = max(longest[b], len(piece))
    for b, c in alphabet.items():
        if c not in vocab:
            longest[b] = 0  # never a token of its own: dropped, or an unknown (or byte-fallback) token's
    for a in added:
        raw = str(a.get("content", "")).encode("utf-8")
        for b in set(raw):
            if longest[b]:
                longest[b] = max(longest[b], len(raw))
    return ByteBound(longest)


def checked_ids(prompt_ids: Sequence[int], budget: int, vocab: int | None = None) -> list[int]:
    """A request's ready-made ``prompt_ids``, checked against ``budget`` and, when known, the vocabulary
    size. Raises PromptTooLarge or ValueError."""
    ids = [int(t) for t in prompt_ids]
    if vocab is not None and not all(0 <= t < vocab for t in ids):
        raise ValueError("prompt_ids outside the vocabulary")
    if len(ids) > budget:
        raise PromptTooLarge(f"prompt is {len(ids)} tokens; at most {budget}")
    return ids
