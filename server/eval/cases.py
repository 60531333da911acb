"""The prompts ``tokenwire eval`` asks, each with the check a program runs on the reply (checks.py).

Five kinds: facts (some asked in French or Spanish), arithmetic, code run against asserts, instruction
following (length, format) and recall of an earlier turn. The prompts are what a newcomer types into the
UI on the first day, phrased plainly, so the scores say which sampling settings serve such a user best;
they are not a benchmark of the model. Multi-turn cases carry the earlier turns as history, with the
assistant's turn written out, so every setting is asked the same last question.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from pathlib import Path

from server.eval.checks import (
    Check,
    all_caps,
    bullets,
    contains,
    ends_with,
    exactly,
    json_equals,
    last_number,
    python_passes,
    word_count,
)

KINDS = ("fact", "arithmetic", "code", "format", "recall")
UI_PAGE = Path(__file__).resolve().parents[2] / "client_js" / "ui" / "index.html"


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    kind: str
    messages: tuple[tuple[str, str], ...]  # (role, content), the last one the user's question
    check: Check

    def chat(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]


def _ask(name: str, kind: str, question: str, check: Check) -> Case:
    return Case(name, kind, (("user", question),), check)


def _recall(name: str, said: str, answered: str, question: str, check: Check) -> Case:
    return Case(name, "recall", (("user", said), ("assistant", answered), ("user", question)), check)


_NUMBER_ONLY = " Answer with just the number."

CASES: tuple[Case, ...] = (
    # facts
    _ask("capital-france", "fact", "What is the capital of France?", contains("Paris")),
    _ask("capital-japan", "fact", "What is the capital of Japan?", contains("Tokyo")),
    _ask("capital-germany-fr", "fact", "Quelle est la capitale de l'Allemagne ?", contains("Berlin")),
    _ask("capital-spain-es", "fact", "¿Cuál es la capital de España?", contains("Madrid")),
    _ask("days-week", "fact", "How many days are there in a week?", contains("7", "seven")),
    _ask("spider-legs", "fact", "How many legs does a spider have?", contains("8", "eight")),
    _ask("planet", "fact", "Which planet do we live on?", contains("Earth")),
    _ask("ocean", "fact", "What is the largest ocean on Earth?", contains("Pacific")),
    _ask(
        "plants-gas", "fact", "Which gas do plants take in from the air?", contains("carbon dioxide", "CO2")
    ),
    _ask("romeo", "fact", "Who wrote Romeo and Juliet?", contains("Shakespeare")),
    _ask("water-freezes", "fact", "At how many degrees Celsius does water freeze?", contains("0", "zero")),
    _ask("water-formula", "fact", "What is the chemical formula of water?", contains("H2O", "H₂O")),
    # arithmetic
    _ask("add-small", "arithmetic", "What is 2 + 3?" + _NUMBER_ONLY, last_number(5)),
    _ask("add-tens", "arithmetic", "What is 12 + 30?" + _NUMBER_ONLY, last_number(42)),
    _ask("subtract", "arithmetic", "What is 15 - 6?" + _NUMBER_ONLY, last_number(9)),
    _ask("multiply", "arithmetic", "What is 7 times 8?" + _NUMBER_ONLY, last_number(56)),
    _ask("square", "arithmetic", "What is 9 times 9?" + _NUMBER_ONLY, last_number(81)),
    _ask("divide", "arithmetic", "What is 100 divided by 4?" + _NUMBER_ONLY, last_number(25)),
    _ask("add-fr", "arithmetic", "Combien font 2 + 2 ? Réponds seulement par le nombre.", last_number(4)),
    # code: the reply's code runs with these asserts after it, in a subprocess with a timeout
    _ask(
        "reverse-string",
        "code",
        "Write a Python function that reverses a string.",  # the UI's example, as the issue found it
        python_passes(  # any function the reply defines, whatever its name
            "def _ok(f):\n"
            "    try:\n"
            "        return f('hello') == 'olleh' and f('') == ''\n"
            "    except Exception:\n"
            "        return False\n"
            "assert any(_ok(v) for k, v in list(globals().items())"
            " if callable(v) and not k.startswith('_') and getattr(v, '__module__', '') == '__main__')"
        ),
    ),
    _ask(
        "add-function",
        "code",
        "Write a Python function add(a, b) that returns the sum of a and b.",
        python_passes("assert add(2, 3) == 5\nassert add(-1, 1) == 0"),
    ),
    _ask(
        "is-even",
        "code",
        "Write a Python function is_even(n) that returns True if n is even and False otherwise.",
        python_passes("assert is_even(4) is True\nassert is_even(7) is False\nassert is_even(0) is True"),
    ),
    _ask(
        "factorial",
        "code",
        "Write a Python function factorial(n) that returns n factorial.",
        python_passes("assert factorial(0) == 1\nassert factorial(5) == 120"),
    ),
    _ask(
        "count-vowels",
        "code",
        "Write a Python function count_vowels(s) that returns how many vowels (a, e, i, o, u) the string s"
        " contains.",
        python_passes("assert count_vowels('hello') == 2\nassert count_vowels('xyz') == 0"),
    ),
    _ask(
        "largest",
        "code",
        "Write a Python function largest(numbers) that returns the largest number in a list.",
        python_passes("assert largest([3, 9, 2]) == 9\nassert largest([-5, -2]) == -2"),
    ),
    # instruction following: length and format
    _ask(
        "one-word",
        "format",
        "What colour is grass? Reply with exactly one word.",
        word_count(1, 1, contains("green")),
    ),
    _ask("yes-no", "format", "Is the Sun a star? Reply with only yes or no.", exactly("yes")),
    _ask(
        "three-bullets",
        "format",
        "List three fruits as a bulleted list, one fruit per line.",
        bullets(3),
    ),
    # The UI's example until this eval: three list items, each titled "**101:101:101**". Kept to show it.
    _ask("cook-tips", "format", "Give me three tips for learning to cook.", bullets(3)),
    _ask("short-answer", "format", "In fewer than 20 words: why do people sleep?", word_count(1, 19)),
    _ask(
        "upper-case",
        "format",
        "What is the capital of Italy? Write your whole answer in capital letters.",
        all_caps(contains("ROME", "ROMA")),
    ),
    _ask(
        "json",
        "format",
        'Reply with only a JSON object with the keys "name" and "age" for a person named Bob who is 30.',
        json_equals({"name": "Bob", "age": 30}),
    ),
    _ask("count-five", "format", "Count from 1 to 5, separated by commas.", contains("1, 2, 3, 4, 5")),
    _ask(
        "exclamation",
        "format",
        "Write one sentence about cats that ends with an exclamation mark.",
        ends_with("!", contains("cat", "cats")),
    ),
    _ask(
        "translate",
        "format",
        "Translate 'thank you' into Spanish. Reply with only the translation.",
        word_count(1, 3, contains("gracias")),
    ),
    # recall of an earlier turn
    _recall(
        "name",
        "Hi, my name is Priya.",
        "Nice to meet you, Priya! How can I help you today?",
        "What is my name?",
        contains("Priya"),
    ),
    _recall(
        "colour",
        "My favourite colour is teal.",
        "Teal is a lovely colour! Is there anything I can help you with?",
        "What is my favourite colour?",
        contains("teal"),
    ),
    _recall(
        "city",
        "I live in Lisbon.",
        "Lisbon is a beautiful city. What would you like to talk about?",
        "Which city do I live in?",
        contains("Lisbon"),
    ),
    _recall(
        "number",
        "Please remember the number 42.",
        "Got it, I will remember the number 42.",
        "Which number did I ask you to remember?",
        contains("42", "forty-two"),
    ),
    _recall(
        "dog",
        "My dog is called Biscuit.",
        "Biscuit is a great name for a dog!",
        "What is my dog called?",
        contains("Biscuit"),
    ),
    _recall(
        "age", "I am 25 years old.", "Thanks for telling me!", "How old am I?", contains("25", "twenty-five")
    ),
)


def ui_examples(page: Path = UI_PAGE) -> list[str]:
    """The example prompts of the browser UI's empty state: each is also a case, so the eval scores
    what a newcomer clicks first (tests/eval/test_checks.py holds them to it)."""
    buttons = re.findall(r'<button[^>]*class="example"[^>]*>(.*?)</button>', page.read_text(), re.DOTALL)
    return [html.unescape(b.strip()) for b in buttons]
