"""What kind of answer a question wants, and when two text answers are the same answer.

`detect_kind` (``answer: auto``) reads the question with four ordered rules, each named in the trace:

1. ``choice``: two or more option markers, "(A)" or "A." / "A)" / "A:" at a line's start.
2. ``yes_no``: the question's last sentence opens with an auxiliary verb ("Is", "Does", "Can", "Was", ...)
   and offers no alternative (" or ").
3. ``number``: arithmetic between numbers ("17 * 3"), or "how many" / "how much", or a number with a
   quantity word ("total", "cost", "left", "percent", ...), or two or more numbers in a question that
   asks "how ...", "what ...", "calculate" or "find" (a word problem).
4. ``text``: everything else.

`AnswerCanon` maps each extracted answer to a canonical one so that the exact-match logic of
Exchange-of-Thought (agreement, majority, confidence) applies to every kind: numbers, letters and yes/no
are canonical already; a text answer becomes the first answer seen that it matches, by normalised text
(`normalise_text`) or by embedding cosine (all-MiniLM-L6-v2) at or above ``threshold``."""

from __future__ import annotations

import asyncio
import re

import numpy as np

from chorus.ensembles.answers.extract import normalise_text
from chorus.ensembles.similarity import Embedder

OPTION = re.compile(r"\([A-E]\)|(?m:^\s*[A-E][.):]\s)")
AUX = re.compile(r"^\s*(is|are|was|were|am|do|does|did|can|could|will|would|should|shall|has|have|had|may|might|"
                 r"must|isn't|aren't|doesn't|don't|didn't|can't|won't)\b", re.IGNORECASE)
ARITHMETIC = re.compile(r"\d\s*[-+*/x\u00d7\u00f7^]\s*\d|\d\s*(plus|minus|times|divided by)\s*\d", re.IGNORECASE)
HOW_MANY = re.compile(r"\bhow (many|much)\b", re.IGNORECASE)
QUANTITY = re.compile(r"\b(total|sum|product|difference|average|percent|percentage|cost|costs|left|remain|"
                      r"remaining|altogether|each|per|times|twice|half|convert)\b", re.IGNORECASE)
DIGIT = re.compile(r"\d")
NUMBERS = re.compile(r"\d+(?:[.,]\d+)?")
ASKS = re.compile(r"\b(how|what|calculate|find|compute)\b", re.IGNORECASE)
SENTENCE = re.compile(r"[^.?!]+[.?!]*")
PLACEHOLDER_LINE = re.compile(r"^[\"']?the answer is:? [\"']?(x|\.\.\.)[\"']?\.?[\"']?\.?$")
# where a small model starts writing the exchange prompt itself ("Agent quick: ...", "User: ...")
SCAFFOLD = re.compile(r"^\s*(agent \w+( \(confidence [\d.]+\))?:|your previous solution:|solutions from other agents:|"
                      r"use the other solutions|(user|assistant|system)( \w+)?:)", re.IGNORECASE | re.MULTILINE)


def last_sentence(text: str) -> str:
    sentences = [x.strip() for x in SENTENCE.findall(text) if x.strip()]
    return sentences[-1] if sentences else text


def clean_reply(text: str, echoes: list[str]) -> str:
    """A yes/no or text reply without what a small model copied from its prompt or looped on: cut where it
    starts writing the exchange prompt's scaffolding; drop lines that repeat the question, the instruction,
    an earlier line, or the instruction's placeholder ("The answer is: X")."""
    if (m := SCAFFOLD.search(text)) and m.start() > 0:
        text = text[:m.start()]
    seen = {" ".join(e.split()).lower() for e in echoes if e.strip()}
    lines: list[str] = []
    for line in text.splitlines():
        key = " ".join(line.split()).lower()
        if key and (key in seen or PLACEHOLDER_LINE.match(key)):
            continue
        if key or (lines and lines[-1].strip()):
            lines.append(line)
        if key:
            seen.add(key)
    return "\n".join(lines).strip()


def answer_kind(question: str, answer: str) -> tuple[str, str]:
    """(kind, rule) of the answers to ``question``: ``answer`` as the request gives it, or for ``auto`` the one
    `detect_kind` reads from the question."""
    return detect_kind(question) if answer == "auto" else (answer, "given")


def detect_kind(question: str) -> tuple[str, str]:
    """(kind, the rule that decided it)."""
    if len(OPTION.findall(question)) >= 2:
        return "choice", "option markers (A), (B) ..."
    if AUX.match(last_sentence(question)) and " or " not in last_sentence(question).lower():
        return "yes_no", "opens with an auxiliary verb, no alternatives"
    if ARITHMETIC.search(question):
        return "number", "arithmetic between numbers"
    if HOW_MANY.search(question):
        return "number", "'how many' / 'how much'"
    if DIGIT.search(question) and QUANTITY.search(question):
        return "number", "numbers with a quantity word"
    if len(NUMBERS.findall(question)) >= 2 and ASKS.search(question):
        return "number", "a word problem: two or more numbers and a question"
    return "text", "none of the choice, yes/no or number rules"


class AnswerCanon:
    """One request's canonical answers (see the module docstring). ``threshold``: the cosine at or above
    which two text answers agree (None: normalised text only)."""

    def __init__(self, kind: str, threshold: float | None = 0.85) -> None:
        self.kind = kind
        self.threshold = threshold
        self.reps: list[str] = []          # canonical answers, first seen first
        self._norms: list[str] = []
        self._emb: list[np.ndarray] = []
        self.how: dict[str, str] = {}      # answer -> "new" | "normalised: rep" | "embedding 0.91: rep"
        self.of: dict[str, str] = {}       # answer -> its canonical answer

    async def canon(self, answers: list[str]) -> list[str]:
        if self.kind != "text":
            return answers
        out = []
        need = [a for a in dict.fromkeys(answers) if a and a not in self.how]
        vectors = dict(zip(need, await asyncio.to_thread(Embedder.embed, need))) if need and self.threshold else {}
        for a in answers:
            if a and a not in self.of:
                self.of[a] = self._one(a, vectors.get(a))
            out.append(self.of[a] if a else "")
        return out

    def _one(self, answer: str, vec: np.ndarray | None) -> str:
        norm = normalise_text(answer)
        for rep, n in zip(self.reps, self._norms):
            if norm and n == norm:
                self.how[answer] = f"normalised: {rep!r}"
                return rep
        if vec is not None and self._emb and self.threshold is not None:
            sims = np.array([float(vec @ e) for e in self._emb])
            best = int(np.argmax(sims))
            if sims[best] >= self.threshold:
                self.how[answer] = f"embedding {sims[best]:.3f}: {self.reps[best]!r}"
                return self.reps[best]
        self.reps.append(answer)
        self._norms.append(norm)
        if vec is not None:  # every new answer was embedded (when a threshold is set)
            self._emb.append(vec)
        self.how[answer] = "new"
        return answer
