"""Incremental detokenisation: whole UTF-8 only, stop strings never leak, offsets add up."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st

from server.engine.detok import Detokenizer


# A byte-level toy vocabulary: token i is one byte, so multi-byte characters span several tokens.
def decode(ids: Sequence[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def run(text: str, stop: tuple[str, ...] = ()) -> tuple[list[tuple[int, str]], bool]:
    d = Detokenizer(decode, stop)
    out: list[tuple[int, str]] = []
    stopped = False
    for b in text.encode():
        em = d.add(b)
        if em is not None:
            out.append((em.n, em.text))
            if em.stopped:
                stopped = True
                break
    if not stopped:
        em = d.finish()
        if em is not None:
            out.append((em.n, em.text))
    return out, stopped


def test_multibyte_characters_are_emitted_whole() -> None:
    out, _ = run("é東🚀")
    assert [t for _, t in out] == ["é", "東", "🚀"]
    assert [n for n, _ in out] == [2, 3, 4]


def test_stop_string_is_cut_and_never_emitted() -> None:
    out, stopped = run("Hello END world", stop=("END",))
    assert stopped
    assert "".join(t for _, t in out) == "Hello "
    # "E" and "N" were held back (they might start END), never shown then retracted
    assert all("E" not in t for _, t in out)


def test_held_prefix_is_released_when_it_is_not_a_stop() -> None:
    out, stopped = run("an ENd", stop=("END",))
    assert not stopped and "".join(t for _, t in out) == "an ENd"


def test_prime_does_not_reemit() -> None:
    d = Detokenizer(decode)
    d.prime(list(b"abc"))
    em = d.add(ord("d"))
    assert em is not None and (em.n, em.text) == (1, "d")


@given(st.text(max_size=40), st.lists(st.text(min_size=1, max_size=4), max_size=2))
def test_emissions_cover_every_token_and_the_text(text: str, stops: list[str]) -> None:
    out, stopped = run(text, tuple(stops))
    emitted = "".join(t for _, t in out)
    if stopped:
        # Generation stops at the first point where some stop string is complete, and the text is cut at
        # the start of the stop strings completed there (a longer one that starts earlier but would end
        # later never gets the chance: e.g. stops "g" and "0g0" on "0g0" give "0").
        hits = [(i + len(s), i) for s in stops for i in range(len(text)) if text.startswith(s, i)]
        end = min(e for e, _ in hits)
        assert emitted == text[: min(i for e, i in hits if e == end)]
    else:
        assert emitted == text
        assert sum(n for n, _ in out) == len(text.encode())


def test_push_applies_eos_stop_and_length_rules() -> None:
    d = Detokenizer(decode, ("END",))
    assert d.push(ord("a"), eos=False, at_length=False) == (1, "a", None)
    assert d.push(ord("E"), eos=False, at_length=False) == (0, "", None)  # held: may start END
    assert d.push(ord("x"), eos=False, at_length=True) == (2, "Ex", "length")  # length flushes what is held
    d = Detokenizer(decode)
    assert d.push(0xC3, eos=False, at_length=False) == (0, "", None)  # half of "é"
    assert d.push(2, eos=True, at_length=False) == (2, "\ufffd", "stop")  # EOS counts, has no text
    d = Detokenizer(decode, ("END",))
    assert [d.push(b, eos=False, at_length=False) for b in b"hiEND"][-1] == (3, "", "stop")
