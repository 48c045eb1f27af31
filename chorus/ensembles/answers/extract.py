"""Answer extraction from a model's solution text (docs/methods.md §2, as the EoT reference code does).

- ``number``: the text after the last of the forms models end with: "the answer is", ``\boxed{`` (LaTeX, which
  Qwen models end with), "final answer" ("Final Answer: ...", "the final answer is ...") or an "Answer:" label at
  a line's start (or the whole text if none is there), thousands commas dropped; the first number there if a
  form was found (in a box, its content's last number: ``\boxed{6W_0 + 16}`` is 16), else the last number in the
  text; a trailing "." stripped; integral values written without
  decimals ("42.0" -> "42"), others in their shortest form ("72.50" -> "72.5"), so equal numbers are one answer.
  (The reference code reads only "the answer is": "\boxed{1400} bananas for 2 months" was read as 2.)
- ``choice``: the option letter (A-E) after the last "the answer is", else the last standalone letter.
- ``yes_no``: "yes" or "no": the first of the two words after the last "the answer is", else the first in
  the text (small models open with "Yes, ...").
- ``text``: the rest of the line after the last "the answer is" or "Answer:" (up to the next such label)
  that is not the instruction's placeholder echoed ("X", "where X is ...") or a negation ("the answer is
  not ..."), else the text's first sentence that is not a question (small
  models answer first, then ramble); a leading ":", trailing punctuation, quotes and markdown emphasis
  dropped; at most 200 characters.
  Compare text answers with `normalise_text` (and, in the ensembles, embeddings).
- a custom regular expression: its first group (or whole match) at the last match.

No answer -> ``""``, which votes ignore.
"""

from __future__ import annotations

import re

PHRASE = re.compile(r"the answer is", re.IGNORECASE)
#: where a number answer starts: the EoT phrase, LaTeX's box, a "final answer", an "Answer:" label
FINAL = re.compile(r"the answer is|\\boxed\s*\{|final answer|^\W*answer\W*:", re.IGNORECASE | re.MULTILINE)
NUMBER = re.compile(r"-?\d+\.?\d*")
CHOICE = re.compile(r"\(?\b([A-E])\b\)?")
YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
ARTICLES = re.compile(r"\b(a|an|the)\b")
PUNCTUATION = re.compile(r"[^\w\s]")
LABEL = re.compile(r"the answer is\s*:?|^\s*answer\s*:", re.IGNORECASE | re.MULTILINE)
PLACEHOLDER = re.compile(r"^(x|\.\.\.|your (short )?answer)$|where x is", re.IGNORECASE)  # the instruction echoed
NEGATION = re.compile(r"not\b", re.IGNORECASE)  # "the answer is not ...": no answer there
SENTENCE = re.compile(r"[^\n.?!]+(?:[.?!]+|$)", re.MULTILINE)
KINDS = ("number", "choice", "yes_no", "text")
TEXT_LIMIT = 200


def normalise_text(s: str) -> str:
    """SQuAD's answer normalisation: lower case, punctuation and articles dropped, spaces collapsed."""
    return " ".join(ARTICLES.sub(" ", PUNCTUATION.sub(" ", s.lower())).split())


def _clean(s: str) -> str:
    return s.lstrip(":").strip().strip("*_\"'` ").rstrip(".!").strip("*_\"'` ")[:TEXT_LIMIT]


def _text_answer(text: str) -> str:
    labels = list(LABEL.finditer(text))
    for i in reversed(range(len(labels))):
        end = labels[i + 1].start() if i + 1 < len(labels) else len(text)  # up to the next label
        line = _clean(text[labels[i].end():end].split("\n", 1)[0])
        if line and not PLACEHOLDER.search(line) and not NEGATION.match(line):
            return line
    for sentence in SENTENCE.findall(text):
        if sentence.strip().endswith("?") or LABEL.match(sentence.strip()):
            continue
        if (line := _clean(sentence)) and not PLACEHOLDER.search(line):
            return line
    return ""


def _after_phrase(text: str) -> tuple[str, bool]:
    found = list(PHRASE.finditer(text))
    return (text[found[-1].end():], True) if found else (text, False)


def _canonical_number(s: str) -> str:
    s = s.rstrip(".")
    try:
        value = float(s)
    except ValueError:
        return s
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value) if abs(value) < 1e15 else s  # "72.50" and "72.5" are one answer


def extract_answer(text: str, kind: str = "number", pattern: re.Pattern[str] | None = None) -> str:
    if pattern is not None:
        matches = list(pattern.finditer(text))
        if not matches:
            return ""
        last = matches[-1]
        return (last.group(1) if last.groups() else last.group(0)).strip()
    tail, had_phrase = _after_phrase(text)
    if kind == "yes_no":
        found = YES_NO.search(tail) or (YES_NO.search(text) if had_phrase else None)
        return found.group(1).lower() if found else ""
    if kind == "text":
        return _text_answer(text)
    if kind == "choice":
        letters = CHOICE.findall(tail)
        return (letters[0] if had_phrase else letters[-1]) if letters else ""
    marks = list(FINAL.finditer(text))
    tail, had_phrase = (text[marks[-1].end():], True) if marks else (text, False)
    if marks and marks[-1].group(0).lower().startswith("\\boxed"):  # the box's content: its last number
        numbers = NUMBER.findall(braced(tail).replace(",", ""))  # ("6W_0 + 16" -> 16)
        return _canonical_number(numbers[-1]) if numbers else ""
    numbers = NUMBER.findall(tail.replace(",", ""))
    if not numbers:
        return ""
    return _canonical_number(numbers[0] if had_phrase else numbers[-1])


def braced(tail: str) -> str:
    """The text up to the ``}`` that closes a brace just opened (``tail`` follows the ``{``), nested braces kept."""
    depth = 1
    for i, ch in enumerate(tail):
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return tail[:i]
    return tail


def compile_pattern(pattern: str | None) -> re.Pattern[str] | None:
    """Compile a user's answer regex; ``ValueError`` with the reason if it is not valid."""
    if pattern is None:
        return None
    try:
        return re.compile(pattern, re.IGNORECASE | re.DOTALL)
    except re.error as exc:
        raise ValueError(f"answer_pattern is not a valid regular expression: {exc}") from None
