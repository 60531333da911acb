"""The eval's checks: each passes a right answer in the forms a model writes it and fails a wrong one;
code runs isolated and bounded; the loop detector tells a loop from a long answer."""

from __future__ import annotations

import pytest

from server.eval import checks
from server.eval.cases import CASES, KINDS


def test_contains_is_whole_word_and_case_free() -> None:
    c = checks.contains("Paris", "7")
    assert c("The capital of France is paris.")
    assert c("There are 7 days.")
    assert not c("Parisian cafés")  # a longer word is not the answer
    assert not c("17 days")


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("5", True),
        ("2 + 3 = 5.", True),
        ("The answer is 5!", True),
        ("5, then 2 + 4 = 6", False),
        ("", False),
    ],
)
def test_last_number(text: str, ok: bool) -> None:
    assert checks.last_number(5)(text) is ok


def test_last_number_reads_thousands_separators() -> None:
    assert checks.last_number(1200)("It is 1,200.")


def test_length_and_format_checks() -> None:
    assert checks.word_count(1, 1, checks.contains("green"))("Green.")
    assert not checks.word_count(1, 1, checks.contains("green"))("It is green.")
    assert checks.exactly("yes")("Yes.")
    assert not checks.exactly("yes")("Yes, the Sun is a star.")
    assert checks.bullets(3)("Fruits:\n- apple\n- pear\n* plum")
    assert checks.bullets(3)("1. apple\n2. pear\n3. plum\n\nEnjoy!")
    assert not checks.bullets(3)("- apple\n- pear")
    assert checks.all_caps(checks.contains("ROME"))("THE CAPITAL OF ITALY IS ROME.")
    assert not checks.all_caps(checks.contains("ROME"))("The capital is ROME.")
    assert checks.ends_with("!", checks.contains("cat"))("My cat loves boxes!")
    assert not checks.ends_with("!", checks.contains("cat"))("My cat loves boxes.")


def test_json_in_a_fence_or_bare() -> None:
    c = checks.json_equals({"name": "Bob", "age": 30})
    assert c('{"name": "Bob", "age": 30}')
    assert c('Here it is:\n```json\n{"age": 30, "name": "Bob"}\n```')
    assert not c('{"name": "Bob", "age": "30"}')
    assert not c("name: Bob, age: 30")


def test_code_is_judged_by_its_definitions() -> None:
    c = checks.python_passes("assert add(2, 3) == 5")
    assert c("```python\ndef add(a, b):\n    return a + b\n```\nExample:\n```python\nprint(add([]))\n```")
    assert c("def add(a, b):\n    return a + b")  # no fence
    assert not c("```python\ndef add(a, b):\n    return a - b\n```")
    assert not c("```python\ndef add(a, b) return a + b\n```")  # does not parse
    assert not c("You can use the + operator.")


def test_code_runs_isolated_and_bounded(tmp_path: object) -> None:
    # An endless loop is cut by the timeout, not waited for; input() finds no stdin; the process has no
    # environment of ours.
    assert not checks.run_python("while True:\n    pass", timeout=1.0)
    assert not checks.run_python("input()")
    assert checks.run_python("import os\nassert 'REDIS_URL' not in os.environ")
    assert not checks.run_python("x = bytearray(2 << 30)")  # over the memory limit


@pytest.mark.parametrize(
    "text",
    [
        "I am a helpful assistant. I am a helpful assistant. I am a helpful assistant. I am",
        "Sure!\nThe answer is here\nThe answer is here\nThe answer is here\n",
        "and so on and so on and so on and so on and so on and so on and so on",
    ],
)
def test_looped(text: str) -> None:
    assert checks.looped(text)


@pytest.mark.parametrize(
    "text",
    [
        "Paris is the capital of France. It is known for the Eiffel Tower and its museums.",
        "- apple\n- pear\n- plum",
        "1, 2, 3, 4, 5",
        "```python\ndef f(s):\n    return s[::-1]\n```\nThis returns s reversed. Use f('abc') to get 'cba'.",
    ],
)
def test_not_looped(text: str) -> None:
    assert not checks.looped(text)


def test_the_cases() -> None:
    assert 35 <= len(CASES) <= 45
    assert len({c.name for c in CASES}) == len(CASES)
    assert {c.kind for c in CASES} == set(KINDS)
    for c in CASES:
        assert c.messages[-1][0] == "user"
        assert not c.check(""), c.name  # an empty reply passes nothing
    recall = [c for c in CASES if c.kind == "recall"]
    assert all([role for role, _ in c.messages] == ["user", "assistant", "user"] for c in recall)


def test_the_code_cases_pass_a_right_answer() -> None:
    right = {
        "reverse-string": "def reverse_string(s):\n    return s[::-1]",
        "add-function": "def add(a, b):\n    return a + b",
        "is-even": "def is_even(n):\n    return n % 2 == 0",
        "factorial": "def factorial(n):\n    return 1 if n <= 1 else n * factorial(n - 1)",
        "count-vowels": "def count_vowels(s):\n    return sum(ch in 'aeiou' for ch in s)",
        "largest": "def largest(numbers):\n    return max(numbers)",
    }
    code = {c.name: c for c in CASES if c.kind == "code"}
    assert set(code) == set(right)
    for name, answer in right.items():
        assert code[name].check(f"```python\n{answer}\n```"), name
        assert not code[name].check("```python\ndef nothing():\n    pass\n```"), name


def test_every_ui_example_is_a_case() -> None:
    from server.eval.cases import ui_examples

    examples = ui_examples()
    assert len(examples) == 3
    questions = {c.messages[0][1] for c in CASES if len(c.messages) == 1}
    assert set(examples) <= questions, set(examples) - questions
