"""The newcomer set: the first questions a new user sends to every id ``/v1/models`` lists, each answer checked by a
tolerant rule, with per-id pass counts and times (``scripts/serve-smoke`` runs it against ``make serve``; CI fails
below the threshold).

Five questions, greedy: a capital (the expected word present), a sum (the number present), a yes/no question (the
expected word, and not the other), a one-sentence request (a sentence of a few words on the topic that does not
repeat the request) and a short JSON answer under ``response_format: json_object`` (a JSON object). The rules accept
any wording around the answer: they check that an answer makes sense, not its style. Language models and ensembles
get all five through chat; an embedding model one embedding; a scorer is skipped (it generates nothing).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from chorus.clients.local import markdown_table

MAX_SECONDS = 30.0  #: a question's answer must come within this, on a 2-core machine
MIN_PASS = 4  #: of the five questions, an id must answer at least this many sensibly


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def has_word(word: str, not_word: str | None = None) -> Callable[[str], bool]:
    return lambda text: word in words(text) and (not_word is None or not_word not in words(text))


def has_number(n: int) -> Callable[[str], bool]:
    return lambda text: str(n) in re.findall(r"-?\d+", re.sub(r"(?<=\d),(?=\d{3}\b)", "", text))


SEA = {"sea", "seas", "ocean", "oceans", "wave", "waves", "water", "waters", "tide", "tides", "blue", "salt",
       "salty", "shore", "beach", "fish", "ship", "ships", "deep", "marine", "coast", "sailor", "sailors"}


def a_sentence(text: str) -> bool:
    """A few words on the sea, not the request repeated."""
    w = words(text)
    return len(w) >= 4 and bool(SEA & set(w)) and "sentence about the sea" not in " ".join(w)


def a_json_object(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and len(value) > 0


@dataclass(frozen=True)
class Question:
    name: str
    text: str
    check: Callable[[str], bool]
    extra: dict[str, Any] = field(default_factory=dict)


QUESTIONS = (
    Question("capital", "What is the capital of France? Answer in one word.", has_word("paris")),
    Question("sum", "What is 7 + 5? Answer with the number only.", has_number(12)),
    Question("yes/no", "Is the sun a star? Answer yes or no.", has_word("yes", not_word="no")),
    Question("sentence", "Write one sentence about the sea.", a_sentence),
    Question("json", 'Reply with a JSON object that has one key, "colour", whose value is a colour.', a_json_object,
             {"response_format": {"type": "json_object"}}),
)


@dataclass
class Outcome:
    model: str
    passed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # question -> the answer (or the error)
    seconds: list[float] = field(default_factory=list)

    @property
    def slowest(self) -> float:
        return max(self.seconds, default=0.0)


def ask(client: httpx.Client, model: str, q: Question, max_tokens: int) -> tuple[str, float]:
    t0 = time.monotonic()
    try:
        r = client.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": q.text}],
                                                      "temperature": 0, "max_tokens": max_tokens, **q.extra})
    except httpx.HTTPError as exc:  # a timeout or a dropped connection is this question's failure, not the run's
        return f"{type(exc).__name__}: {exc}", time.monotonic() - t0
    seconds = time.monotonic() - t0
    if r.status_code != 200:
        return f"HTTP {r.status_code}: {r.text[:200]}", seconds
    return r.json()["choices"][0]["message"]["content"] or "", seconds


def check_model(client: httpx.Client, model: str, max_tokens: int = 48) -> Outcome:
    out = Outcome(model)
    for q in QUESTIONS:
        text, seconds = ask(client, model, q, max_tokens)
        out.seconds.append(seconds)
        if q.check(text):
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
    p.add_argument("--min-pass", type=int, default=MIN_PASS, help=f"of {len(QUESTIONS)} (default {MIN_PASS})")
    p.add_argument("--max-seconds", type=float, default=MAX_SECONDS, help="per question (default 30)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--model", action="append", help="only these ids (default: every chat id /v1/models lists)")
    args = p.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.url, headers=headers, timeout=max(120.0, 4 * args.max_seconds)) as client:
        ids = args.model or chat_ids(client)
        outcomes = []
        for model in ids:
            o = check_model(client, model, args.max_tokens)
            outcomes.append(o)
            print(f"newcomer: {model:28} {len(o.passed)}/{len(QUESTIONS)}  slowest {o.slowest:5.1f} s"
                  + "".join(f"\n    {name}: {text[:80]!r}" for name, text in o.failed.items()), flush=True)
    print()
    print(markdown_table(["id", "passed", "of", "slowest (s)", "total (s)", "failed"],
                         [[o.model, len(o.passed), len(QUESTIONS), f"{o.slowest:.1f}", f"{sum(o.seconds):.1f}",
                           ", ".join(o.failed) or "-"] for o in outcomes]))
    bad = [o.model for o in outcomes if len(o.passed) < args.min_pass or o.slowest > args.max_seconds]
    if bad:
        print(f"newcomer: below {args.min_pass}/{len(QUESTIONS)} or slower than {args.max_seconds:g} s a question: "
              + ", ".join(bad), file=sys.stderr)
        return 1
    print(f"newcomer: {len(outcomes)} ids answered at least {args.min_pass}/{len(QUESTIONS)} within "
          f"{args.max_seconds:g} s a question")
    return 0


if __name__ == "__main__":
    sys.exit(main())
