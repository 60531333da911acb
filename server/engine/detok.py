"""Incremental detokenisation with stop strings, for one sequence.

Emits only whole UTF-8 (a token ending inside a multi-byte character is held until the character is
complete) and holds back text that could be the start of a stop string, so a client never sees text that
is later taken back. Pure Python: ``decode`` is the tokenizer's ``ids -> str``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

REPLACEMENT = "\ufffd"
# Re-decode from a few tokens before the unread ones, so merges across token borders come out right
# without decoding the whole completion every step.
CONTEXT_TOKENS = 6


@dataclass(slots=True)
class Emission:
    n: int  # tokens consumed since the last emission
    text: str
    stopped: bool = False  # a stop string was found; text ends before it


@dataclass(slots=True)
class Detokenizer:
    decode: Callable[[Sequence[int]], str]
    stop: tuple[str, ...] = ()
    ids: list[int] = field(default_factory=list)
    text: str = ""  # everything decoded so far (of all ids), including what is held back
    emitted: int = 0  # characters of ``text`` already emitted
    pending: int = 0  # tokens not yet covered by an emission
    _prefix: int = 0  # token index where the decode window starts
    _prefix_text: str = ""  # decode(ids[_prefix:_read]) at the last full read

    def prime(self, ids: Sequence[int]) -> None:
        """Take tokens that were emitted earlier (a resumed request) without emitting them again."""
        self.ids.extend(ids)
        self.text = self.decode(self.ids)
        self.emitted = len(self.text)
        self._prefix = max(0, len(self.ids) - CONTEXT_TOKENS)
        self._prefix_text = self.decode(self.ids[self._prefix :])

    def add(self, token: int) -> Emission | None:
        """Take one new token; returns what can be emitted now (None if everything is held)."""
        self.ids.append(token)
        self.pending += 1
        window = self.decode(self.ids[self._prefix :])
        if window.endswith(REPLACEMENT):
            return None  # inside a multi-byte character
        if not window.startswith(self._prefix_text):
            # The new token changed how earlier text decodes (rare): fall back to a full decode.
            full = self.decode(self.ids)
            new_text = full[len(self.text) :] if full.startswith(self.text) else ""
        else:
            new_text = window[len(self._prefix_text) :]
        self.text += new_text
        self._prefix = max(0, len(self.ids) - CONTEXT_TOKENS)
        self._prefix_text = self.decode(self.ids[self._prefix :])
        return self._emit(final=False)

    def push(self, token: int, *, eos: bool, at_length: bool) -> tuple[int, str, str | None]:
        """The engines' output rules for one new token: ``(n tokens, text, finish reason or None)``.

        EOS is a completion token with no text (``stop``); a stop string ends the text just before it
        (``stop``); ``at_length`` (max_tokens or the context reached with this token) flushes whatever is
        held (``length``). ``n`` is 0 when everything is held back for now.
        """
        if eos:
            em = self.finish()
            return (em.n if em else 0) + 1, em.text if em else "", "stop"
        em = self.add(token)
        if em is not None and em.stopped:
            return em.n, em.text, "stop"
        if at_length:
            tail = self.finish()
            n = (em.n if em else 0) + (tail.n if tail else 0)
            return n, (em.text if em else "") + (tail.text if tail else ""), "length"
        return (em.n, em.text, None) if em is not None else (0, "", None)

    def finish(self) -> Emission | None:
        """Flush what is held (an incomplete character comes out as U+FFFD)."""
        if self.pending and self.decode(self.ids).startswith(self.text):
            self.text = self.decode(self.ids)
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> Emission | None:
        unsent = self.text[self.emitted :]
        if self.stop:
            # Search from a little before the unsent text: a stop string may straddle the border.
            lookback = max(len(s) for s in self.stop) - 1
            start = max(0, self.emitted - lookback)
            hits = [i for s in self.stop if (i := self.text.find(s, start)) != -1]
            if hits:
                cut = max(min(hits), self.emitted)
                out = Emission(self.pending, self.text[self.emitted : cut], stopped=True)
                self.emitted = len(self.text)
                self.pending = 0
                return out
            if not final:
                hold = _held_suffix(unsent, self.stop)
                unsent = unsent[: len(unsent) - hold] if hold else unsent
        if not unsent and not (final and self.pending):
            return None
        out = Emission(self.pending, unsent)
        self.emitted += len(unsent)
        self.pending = 0
        return out


def _held_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
