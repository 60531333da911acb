"""Turning a request into prompt token ids within the model's budget (model-free: takes an encoder)."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class PromptTooLarge(ValueError):
    pass


def fit_messages(
    messages: list[dict[str, str]],
    encode: Callable[[list[dict[str, str]]], list[int]],
    budget: int,
) -> list[int]:
    """Encode ``messages``, dropping the oldest non-system turns until the prompt fits ``budget`` tokens.

    The system prompt and the latest message are always kept; if those alone do not fit, the request is
    refused (PromptTooLarge) rather than silently answered without its question.
    """
    msgs = list(messages)
    while True:
        ids = encode(msgs)
        if len(ids) <= budget:
            return ids
        droppable = [i for i, m in enumerate(msgs[:-1]) if m.get("role") != "system"]
        if not droppable:
            raise PromptTooLarge(f"prompt is {len(ids)} tokens; this server takes at most {budget}")
        del msgs[droppable[0]]


def prompt_ids_for(
    prompt_ids: Sequence[int] | None,
    messages: list[dict[str, str]],
    encode: Callable[[list[dict[str, str]]], list[int]],
    budget: int,
    vocab: int | None = None,
) -> list[int]:
    """A request's prompt: its ``prompt_ids`` as given (checked against ``budget`` and, when known, the
    vocabulary size) or else its messages through ``fit_messages``. Raises PromptTooLarge or ValueError."""
    if prompt_ids is None:
        return fit_messages(messages, encode, budget)
    ids = [int(t) for t in prompt_ids]
    if vocab is not None and not all(0 <= t < vocab for t in ids):
        raise ValueError("prompt_ids outside the vocabulary")
    if len(ids) > budget:
        raise PromptTooLarge(f"prompt is {len(ids)} tokens; at most {budget}")
    return ids
