"""The newcomer set: the first questions a new user sends to every id ``/v1/models`` lists, graded strictly, with a
quality score per id (``scripts/serve-smoke`` runs it against ``make serve``; the Quickstart's table reports the
scores).

Thirty questions, greedy, six of each kind: facts, arithmetic, yes/no, short instructions and structured output
(JSON under ``response_format: json_object``, checked against a JSON schema). None has the shape of the worked
exchanges the fallback chat template shows a base model (engines/core/hf_tokenizer.py: a capital "in one word",
"What is A + B?", "Is X Y? Answer yes or no.", "one sentence about", "a JSON object with a key"), so a score is
not the preamble's format echoed back.

Strict grading: the expected answer must be *the* answer. A fact or an instruction's answer holds the expected term
and no negation ("not", "never", "cannot", ...: "The capital of France is not Paris." fails); an arithmetic answer's
numbers, other than the question's own, are all the expected one ("7 + 5 = 13 (not 12)" fails); a yes/no answer's
first yes or no is the expected one, without the other, and a "yes" without a negation ("Yes, well, the sun is not
a star." fails); a JSON answer parses and validates against the question's schema (``{"a": 1}`` fails).

What CI gates is what must never break: every chat id answers every question (HTTP 200, a non-empty answer, within
the gateway's own deadline). The quality score (questions right of 30) is reported, not gated: it ranks ids, and a
threshold fitted to what they score today would only pass them. Language models and ensembles get the questions
through chat; an embedding model one embedding; a scorer is skipped (it generates nothing).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import jsonschema

from chorus.clients.local import markdown_table

NEGATIONS = {"not", "no", "never", "cannot", "can't", "isn't", "aren't", "wasn't", "don't", "doesn't", "didn't",
             "won't", "neither", "nor", "none", "nothing", "incorrect", "false", "wrong", "unable", "sorry"}
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def words(text: str) -> list[str]:
    """Lower-case words; apostrophes kept inside a word (isn't), dropped around it ('large')."""
    found = re.findall(r"[a-z0-9']+", text.lower().replace("\u2019", "'"))
    return [w.strip("'") for w in found if w.strip("'")]


def negated(text: str) -> bool:
    w = words(text)
    return bool(NEGATIONS & set(w)) or any(x.endswith("n't") for x in w)


def says(*accepted: str) -> Callable[[str], bool]:
    """One of ``accepted`` (words or phrases) in the answer, and no negation."""
    def check(text: str) -> bool:
        joined = " " + " ".join(words(text)) + " "
        return any(f" {a} " in joined for a in accepted) and not negated(text)
    return check


def numbers(text: str) -> list[float]:
    return [float(n) for n in NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3}\b)", "", text))]


def equals(expected: float, question: str) -> Callable[[str], bool]:
    """The answer's numbers, other than the question's own, are all ``expected`` (at least one), no negation."""
    given = set(numbers(question))

    def check(text: str) -> bool:
        new = [n for n in numbers(text) if n not in given or n == expected]
        return bool(new) and all(n == expected for n in new) and not negated(text)
    return check


def yes_no(expected: str) -> Callable[[str], bool]:
    other = "no" if expected == "yes" else "yes"

    def check(text: str) -> bool:
        w = words(text)
        first = next((x for x in w if x in ("yes", "no")), None)
        if first != expected or other in w:
            return False
        return expected == "no" or not negated(text)  # "No, a cat cannot fly." is a fine no
    return check


def listing(count: int, allowed: set[str]) -> Callable[[str], bool]:
    """``count`` items separated by commas (or "and"), each one of ``allowed``."""
    def check(text: str) -> bool:
        parts = [p.strip(" .!\n\t") for p in re.split(r",|\band\b|\n", text.lower()) if p.strip(" .!\n\t")]
        parts = [p.lstrip("-*0123456789. ") for p in parts]
        return len(parts) == count and all(p in allowed for p in parts) and len(set(parts)) == count
    return check


def exact_text(expected: str) -> Callable[[str], bool]:
    """``expected`` (case kept) as the answer, punctuation and quotes around it aside."""
    return lambda text: text.strip().strip("\"'`.!").strip() == expected


def sentence_with(*topic: str) -> Callable[[str], bool]:
    """A sentence of at least five words that mentions the topic, without a negation (a refusal is not one)."""
    return lambda text: len(words(text)) >= 5 and bool(set(topic) & set(words(text))) and not negated(text)


def json_matching(schema: dict[str, Any]) -> Callable[[str], bool]:
    def check(text: str) -> bool:
        try:
            value = json.loads(text)
        except ValueError:
            return False
        try:
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError:
            return False
        return True
    return check


def one_of_ci(*values: str) -> dict[str, Any]:
    """A JSON schema string that is one of ``values``, any case."""
    return {"type": "string", "pattern": "^(?i:" + "|".join(re.escape(v) for v in values) + ")$"}


@dataclass(frozen=True)
class Question:
    name: str
    kind: str
    text: str
    check: Callable[[str], bool]
    extra: dict[str, Any] = field(default_factory=dict)


JSON = {"response_format": {"type": "json_object"}}
COLOURS = {"red", "blue", "green", "yellow", "orange", "purple", "pink", "black", "white", "brown", "grey", "gray",
           "violet", "indigo", "cyan", "magenta"}


def arithmetic(name: str, text: str, expected: float) -> Question:
    return Question(name, "arithmetic", text, equals(expected, text))


def structured(name: str, text: str, properties: dict[str, Any]) -> Question:
    schema = {"type": "object", "properties": properties, "required": list(properties)}
    return Question(name, "structured", text, json_matching(schema), JSON)


QUESTIONS = (
    Question("red planet", "facts", "Which planet is known as the Red Planet?", says("mars")),
    Question("eiffel", "facts", "In which country is the Eiffel Tower?", says("france")),
    Question("spider", "facts", "How many legs does a spider have?", says("8", "eight")),
    Question("ocean", "facts", "Which is the largest ocean on Earth?", says("pacific", "pacific ocean")),
    Question("brazil", "facts", "Which language do most people in Brazil speak?", says("portuguese")),
    Question("romeo", "facts", "Who wrote the play Romeo and Juliet?", says("shakespeare", "william shakespeare")),
    arithmetic("times", "How much is 9 times 6?", 54),
    arithmetic("subtract", "Subtract 15 from 40. Reply with the result.", 25),
    arithmetic("add", "If you add 23 and 19, what number do you get?", 42),
    arithmetic("halve", "What is half of 18?", 9),
    arithmetic("divide", "Divide 100 by 4. What is the result?", 25),
    arithmetic("double", "Double 35. What do you get?", 70),
    Question("fish", "yes/no", "Do fish live in water? Start your reply with yes or no.", yes_no("yes")),
    Question("cat flies", "yes/no", "Can a cat fly? Start your reply with yes or no.", yes_no("no")),
    Question("even", "yes/no", "Is 7 an even number? Start your reply with yes or no.", yes_no("no")),
    Question("sunrise", "yes/no", "Does the sun rise in the east? Start your reply with yes or no.", yes_no("yes")),
    Question("berlin", "yes/no", "Is Berlin in Germany? Start your reply with yes or no.", yes_no("yes")),
    Question("winter", "yes/no", "Is snow hot? Start your reply with yes or no.", yes_no("no")),
    Question("colours", "instructions", "Name exactly three colours, separated by commas, and nothing else.",
             listing(3, COLOURS)),
    Question("merci", "instructions", "Translate 'thank you' into French.", says("merci")),
    Question("upper", "instructions", "Write the word cat in capital letters, and nothing else.", exact_text("CAT")),
    Question("synonym", "instructions", "Give one synonym of the word 'big'.",
             says("large", "huge", "giant", "enormous", "great", "massive", "vast", "gigantic", "tall")),
    Question("planet", "instructions", "Name one planet of the solar system, and nothing else.",
             says("mercury", "venus", "earth", "mars", "jupiter", "saturn", "uranus", "neptune")),
    Question("dog", "instructions", "Write a short sentence that mentions a dog.", sentence_with("dog", "dogs")),
    structured("japan", 'Answer in JSON: {"capital": <the capital of Japan>}.', {"capital": one_of_ci("Tokyo")}),
    structured("legs", 'Answer in JSON: {"legs": <how many legs a cat has, as a number>}.',
               {"legs": {"type": "number", "const": 4}}),
    structured("sky", 'Answer in JSON: {"colour": <the colour of a clear daytime sky>}.',
               {"colour": one_of_ci("blue", "light blue", "sky blue")}),
    structured("boolean", 'Answer in JSON: {"is_mammal": <true or false: is a whale a mammal?>}.',
               {"is_mammal": {"const": True}}),
    structured("list", 'Answer in JSON: {"numbers": <the list of the first three positive whole numbers>}.',
               {"numbers": {"type": "array", "items": {"type": "number"}, "const": [1, 2, 3]}}),
    structured("person", 'Answer in JSON: {"name": <any first name>, "age": <a whole number between 1 and 120>}.',
               {"name": {"type": "string", "minLength": 1}, "age": {"type": "integer", "minimum": 1, "maximum": 120}}),
)
KINDS = ("facts", "arithmetic", "yes/no", "instructions", "structured")


@dataclass
class Outcome:
    model: str
    passed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # question -> the answer
    errors: dict[str, str] = field(default_factory=dict)  # question -> what went wrong (no answer at all)
    seconds: list[float] = field(default_factory=list)

    @property
    def slowest(self) -> float:
        return max(self.seconds, default=0.0)

    def by_kind(self) -> dict[str, int]:
        right = set(self.passed)
        return {k: sum(q.name in right for q in QUESTIONS if q.kind == k) for k in KINDS}


def ask(client: httpx.Client, model: str, q: Question, max_tokens: int) -> tuple[str | None, str, float]:
    """(answer, error, seconds): an answer (maybe wrong), or None and what went wrong."""
    t0 = time.monotonic()
    try:
        r = client.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": q.text}],
                                                      "temperature": 0, "max_tokens": max_tokens, **q.extra})
    except httpx.HTTPError as exc:  # a timeout or a dropped connection is this question's error, not the run's
        return None, f"{type(exc).__name__}: {exc}", time.monotonic() - t0
    seconds = time.monotonic() - t0
    if r.status_code != 200:
        return None, f"HTTP {r.status_code}: {r.text[:200]}", seconds
    text = r.json()["choices"][0]["message"]["content"] or ""
    return (text, "", seconds) if text.strip() else (None, "an empty answer", seconds)


def check_model(client: httpx.Client, model: str, max_tokens: int = 48, concurrency: int = 4) -> Outcome:
    out = Outcome(model)
    with ThreadPoolExecutor(concurrency) as pool:  # the engine batches the questions in flight
        answers = list(pool.map(lambda q: ask(client, model, q, max_tokens), QUESTIONS))
    for q, (text, error, seconds) in zip(QUESTIONS, answers):
        out.seconds.append(seconds)
        if text is None:
            out.errors[q.name] = error
        elif q.check(text):
            out.passed.append(q.name)
        else:
            out.failed[q.name] = text
    return out


def chat_ids(client: httpx.Client) -> list[str]:
    """The ids that chat: language models and ensembles (not embedders, not scorers)."""
    cards = client.get("/v1/models").json()["data"]
    return sorted(c["id"] for c in cards if c.get("kind") in ("language_model", "ensemble"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chorus.clients.newcomer", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the gateway, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=4, help="questions in flight per id")
    p.add_argument("--timeout", type=float, default=600.0, help="per request; the gateway's own deadline is shorter")
    p.add_argument("--model", action="append", help="only these ids (default: every chat id /v1/models lists)")
    p.add_argument("--json", help="write every answer and score here (the Quickstart's table is made from it)")
    args = p.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.url, headers=headers, timeout=args.timeout) as client:
        ids = args.model or chat_ids(client)
        outcomes = []
        for model in ids:
            o = check_model(client, model, args.max_tokens, args.concurrency)
            outcomes.append(o)
            print(f"newcomer: {model:28} {len(o.passed):2}/{len(QUESTIONS)} right, {len(o.errors)} errors, slowest "
                  f"{o.slowest:5.1f} s" + "".join(f"\n    error {n}: {e[:100]}" for n, e in o.errors.items())
                  + "".join(f"\n    wrong {n}: {t[:80]!r}" for n, t in o.failed.items()), flush=True)
    print()
    print(markdown_table(["id", "right", *KINDS, "errors", "slowest (s)", "total (s)"],
                         [[o.model, f"{len(o.passed)}/{len(QUESTIONS)}", *o.by_kind().values(), len(o.errors),
                           f"{o.slowest:.1f}", f"{sum(o.seconds):.1f}"] for o in outcomes]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"id": o.model, "right": len(o.passed), "of": len(QUESTIONS), "by_kind": o.by_kind(),
                        "passed": o.passed, "failed": o.failed, "errors": o.errors, "seconds": o.seconds}
                       for o in outcomes], f, indent=1)
    broken = [o.model for o in outcomes if o.errors]
    if broken:
        print(f"newcomer: ids that did not answer every question: {', '.join(broken)}", file=sys.stderr)
        return 1
    print(f"newcomer: {len(outcomes)} ids answered all {len(QUESTIONS)} questions (scores above: reported, not gated)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
