"""Answer extraction from a model's solution text (docs/methods.md §2, as the EoT reference code does).

- ``number``: the text after the last "the answer is" (or the whole text if the phrase is absent),
  thousands commas dropped; the first number there if the phrase was present, else the last number in
  the text; a trailing "." stripped; integral values written without decimals ("42.0" -> "42").
- ``choice``: the option letter (A-E) after the last "the answer is", else the last standalone letter.
- a custom regular expression: its first group (or whole match) at the last match.

No answer -> ``""``, which votes ignore.
"""

from __future__ import annotations

import re

PHRASE = re.compile(r"the answer is", re.IGNORECASE)
NUMBER = re.compile(r"-?\d+\.?\d*")
CHOICE = re.compile(r"\(?\b([A-E])\b\)?")
KINDS = ("number", "choice")


def _after_phrase(text: str) -> tuple[str, bool]:
    found = list(PHRASE.finditer(text))
    return (text[found[-1].end():], True) if found else (text, False)


def _canonical_number(s: str) -> str:
    s = s.rstrip(".")
    try:
        value = float(s)
    except ValueError:
        return s
    return str(int(value)) if value.is_integer() and abs(value) < 1e15 else s


def extract_answer(text: str, kind: str = "number", pattern: re.Pattern[str] | None = None) -> str:
    if pattern is not None:
        matches = list(pattern.finditer(text))
        if not matches:
            return ""
        last = matches[-1]
        return (last.group(1) if last.groups() else last.group(0)).strip()
    tail, had_phrase = _after_phrase(text)
    if kind == "choice":
        letters = CHOICE.findall(tail)
        return (letters[0] if had_phrase else letters[-1]) if letters else ""
    numbers = NUMBER.findall(tail.replace(",", ""))
    if not numbers:
        return ""
    return _canonical_number(numbers[0] if had_phrase else numbers[-1])


def compile_pattern(pattern: str | None) -> re.Pattern[str] | None:
    """Compile a user's answer regex; ``ValueError`` with the reason if it is not valid."""
    if pattern is None:
        return None
    try:
        return re.compile(pattern, re.IGNORECASE | re.DOTALL)
    except re.error as exc:
        raise ValueError(f"answer_pattern is not a valid regular expression: {exc}") from None
