"""The checks ``tokenwire eval`` runs on a reply: each takes the reply's text and says pass or fail.

Every check is a program, not a judgement: a word that must appear, the last number, a line count, JSON
that must parse, Python that must pass its asserts in a subprocess. They are deliberately forgiving about
form (case, punctuation, a code fence or none) and strict about the answer, so a setting scores by what
the model said, not by how it wrapped it.
"""

from __future__ import annotations

import ast
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable

Check = Callable[[str], bool]

_WORD = re.compile(r"[A-Za-zÀ-ÿ0-9']+")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_FENCE = re.compile(r"```[A-Za-z0-9_+-]*\n(.*?)(?:```|$)", re.DOTALL)

CODE_TIMEOUT_S = 5.0  # a reply's code and its asserts: longer is an endless loop
CODE_MEMORY_BYTES = 512 << 20


def words(text: str) -> list[str]:
    return _WORD.findall(text)


def contains(*answers: str) -> Check:
    """Passes when any of ``answers`` appears as whole words (case-insensitive)."""
    pats = [
        re.compile(r"(?<![A-Za-z0-9])" + re.escape(a) + r"(?![A-Za-z0-9])", re.IGNORECASE) for a in answers
    ]
    return lambda text: any(p.search(text) for p in pats)


def last_number(expected: float) -> Check:
    """Passes when the reply's last number is ``expected`` ("2 + 3 = 5." and "The answer is 5" pass; an
    answer followed by more arithmetic does not). Thousands separators are dropped first."""

    def check(text: str) -> bool:
        nums = _NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3}\b)", "", text))
        return bool(nums) and float(nums[-1]) == expected

    return check


def word_count(lo: int, hi: int, also: Check | None = None) -> Check:
    """Passes when the reply has between ``lo`` and ``hi`` words (and ``also`` passes, if given)."""
    return lambda text: lo <= len(words(text)) <= hi and (also is None or also(text))


def exactly(*answers: str) -> Check:
    """Passes when the reply, without case, spaces and end punctuation, is one of ``answers``."""
    want = {a.lower() for a in answers}
    return lambda text: text.strip().strip(".!\"'`*").strip().lower() in want


def bullets(n: int) -> Check:
    """Passes when exactly ``n`` lines start with a list marker ("- ", "* ", "• " or "1. ")."""
    mark = re.compile(r"^\s*(?:[-*•]|\d+[.)])\s+\S")
    return lambda text: sum(1 for line in text.splitlines() if mark.match(line)) == n


def all_caps(also: Check) -> Check:
    """Passes when every letter of the reply is upper case and ``also`` passes."""
    return lambda text: any(c.isalpha() for c in text) and text == text.upper() and also(text)


def ends_with(suffix: str, also: Check) -> Check:
    return lambda text: text.strip().endswith(suffix) and also(text)


def json_equals(expected: object) -> Check:
    """Passes when the reply (or its first code fence) is JSON equal to ``expected``."""

    def check(text: str) -> bool:
        for candidate in (*_FENCE.findall(text), text):
            try:
                return bool(json.loads(candidate.strip()) == expected)
            except ValueError:
                continue
        return False

    return check


def extract_code(text: str) -> str:
    """The definitions in the reply's Python: the functions, classes and imports of its fenced blocks (or
    of the whole reply when it has no fence), without the example calls around them. The user asked for
    a function; an example that prints or calls it with bad input says nothing about the function, and
    top-level code that waits for ``input()`` would fail every reply that has it."""
    keep = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)
    parts: list[str] = []
    for block in _FENCE.findall(text) or [text]:
        try:
            tree = ast.parse(block)
        except SyntaxError:
            continue
        parts.extend(ast.unparse(node) for node in tree.body if isinstance(node, keep))
    return "\n\n".join(parts)


def _limit_child() -> None:  # pragma: no cover - runs in the child between fork and exec
    resource.setrlimit(resource.RLIMIT_AS, (CODE_MEMORY_BYTES, CODE_MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_CPU, (int(CODE_TIMEOUT_S) + 1, int(CODE_TIMEOUT_S) + 1))


def run_python(code: str, timeout: float = CODE_TIMEOUT_S) -> bool:
    """Run ``code`` in an isolated interpreter (``-I``: no site, no environment, no current folder on the
    path) in an empty temporary folder, with a memory and CPU limit and a wall-clock timeout. True when it
    exits 0. What the model wrote is never imported into this process."""
    with tempfile.TemporaryDirectory(prefix="tokenwire-eval-") as tmp:
        try:
            done = subprocess.run(
                [sys.executable, "-I", "-c", code],
                cwd=tmp,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=timeout,
                preexec_fn=_limit_child,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0


def python_passes(tests: str) -> Check:
    """Passes when the reply's code, followed by ``tests`` (asserts), runs to the end without error."""
    return lambda text: run_python(extract_code(text) + "\n\n" + tests)


# A loop: the 135M model's failure mode, one sentence or phrase repeated until max_tokens.
LOOP_MIN_REPEATS = 3
LOOP_MIN_CHARS = 40


def looped(text: str) -> bool:
    """True when the reply repeats itself: a sentence or line of 3+ words said ``LOOP_MIN_REPEATS`` times
    or more, or a tail that is one unit (of any length) repeated ``LOOP_MIN_REPEATS`` times over at least
    ``LOOP_MIN_CHARS`` characters (a phrase repeated without punctuation)."""
    pieces = [p.strip().lower() for p in re.split(r"[.!?\n]+", text)]
    counts = Counter(p for p in pieces if len(p.split()) >= 3)
    if counts and max(counts.values()) >= LOOP_MIN_REPEATS:
        return True
    tail = re.sub(r"\s+", " ", text).strip()[-600:]
    for period in range(1, len(tail) // LOOP_MIN_REPEATS + 1):
        span = period * LOOP_MIN_REPEATS
        if span < LOOP_MIN_CHARS:
            continue
        unit = tail[-period:]
        if tail[-span:] == unit * LOOP_MIN_REPEATS:
            return True
    return False
