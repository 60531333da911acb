"""Turning a conversation into prompt token ids within a budget, before it reaches the engine thread.

Two rules shape this module:

* **User text is text.** The chat template is rendered with a placeholder in place of each message's
  content; the template's own text between the placeholders (its markers, roles, generation prompt) is
  tokenised with special tokens recognised, and every message's content is tokenised as ordinary text, so
  a user who types ``<|im_start|>system`` gets the tokens of those characters, never a control token.
* **Fitting is linear.** Each message's content is tokenised at most once. The oldest non-system turns
  are dropped by their token counts (newest kept first) instead of re-rendering and re-tokenising the
  whole conversation per dropped turn, and a prompt whose length alone proves it cannot fit (every token
  covers at most ``max_token_chars`` characters) is refused before any of it is tokenised.

Model-free: the template and the tokenizer come in as callables (``ChatPrompter``), or from a Hugging Face
tokenizer (``ChatPrompter.for_tokenizer``).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import Any

Messages = list[dict[str, str]]
Render = Callable[[Messages], str]  # the chat template: messages -> text, ready for the assistant's turn
EncodeMany = Callable[[list[str]], list[list[int]]]


class PromptTooLarge(ValueError):
    pass


class ChatPrompter:
    """Messages -> prompt ids through a chat template, content as plain text, fitted to a budget.

    ``render`` is the template; ``encode_text`` tokenises content (special-token strings as text);
    ``encode_markup`` tokenises the template's own text (special tokens recognised). Both take a batch.
    ``max_token_chars`` bounds how many characters one token covers (None: no early refusal).
    """

    def __init__(
        self,
        render: Render,
        encode_text: EncodeMany,
        encode_markup: EncodeMany,
        *,
        max_token_chars: int | None = None,
    ) -> None:
        self.render = render
        self.encode_text = encode_text
        self.encode_markup = encode_markup
        self.max_token_chars = max_token_chars
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
        self._refuse_if_provably_large(messages, required, budget)
        content: dict[int, list[int]] = dict(
            zip(required, self.encode_text([messages[i]["content"] for i in required]), strict=True)
        )
        # Template cost per message (its header and trailer around the content), from one rendering of
        # the whole conversation with placeholders: cheap, and no content is tokenised for it.
        markup = self.encode_markup(self._segments(messages))
        head = len(markup[-1])  # what follows the last content: the generation prompt
        cost = {i: len(markup[i]) for i in range(len(messages))}
        used = head + sum(cost[i] + len(content[i]) for i in required)
        if used > budget:
            raise PromptTooLarge(f"prompt is {used} tokens; this server takes at most {budget}")
        kept = set(required)
        for i in range(last - 1, -1, -1):  # newest optional turn first: drop the oldest
            if i in kept:
                continue
            left = budget - used - cost[i]
            if self.max_token_chars and len(messages[i]["content"]) > left * self.max_token_chars:
                break  # provably over: no need to tokenise it (nor anything older)
            ids = self.encode_text([messages[i]["content"]])[0]
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

    def _refuse_if_provably_large(self, messages: Messages, required: Sequence[int], budget: int) -> None:
        if not self.max_token_chars:
            return
        chars = sum(len(messages[i]["content"]) for i in required)
        least = -(-chars // self.max_token_chars)  # tokens the required content needs at the very least
        if least > budget:
            raise PromptTooLarge(
                f"prompt is at least {least} tokens ({chars} characters); this server takes at most {budget}"
            )

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
        text_tok = Tokenizer.from_str(backend.to_str())
        text_tok.encode_special_tokens = True
        markup_tok = Tokenizer.from_str(backend.to_str())
        markup_tok.encode_special_tokens = False

        def encode_text(texts: list[str]) -> list[list[int]]:
            return [e.ids for e in text_tok.encode_batch(texts, add_special_tokens=False)]

        def encode_markup(texts: list[str]) -> list[list[int]]:
            return [e.ids for e in markup_tok.encode_batch(texts, add_special_tokens=False)]

        longest = max((len(t) for t in backend.get_vocab(with_added_tokens=True)), default=0)
        prompter = ChatPrompter(render, encode_text, encode_markup, max_token_chars=longest or None)
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


def checked_ids(prompt_ids: Sequence[int], budget: int, vocab: int | None = None) -> list[int]:
    """A request's ready-made ``prompt_ids``, checked against ``budget`` and, when known, the vocabulary
    size. Raises PromptTooLarge or ValueError."""
    ids = [int(t) for t in prompt_ids]
    if vocab is not None and not all(0 <= t < vocab for t in ids):
        raise ValueError("prompt_ids outside the vocabulary")
    if len(ids) > budget:
        raise PromptTooLarge(f"prompt is {len(ids)} tokens; at most {budget}")
    return ids
