"""`chorus bench answers`: the answer-side ensembles on GSM8K, from the answers `chorus eval gsm8k` cached.

Every answer was drawn through chorus's API (the served models, one request per greedy answer or per batch of
samples); this bench replays the served strategies' decision functions (`ensembles.voting`, the cascade fit of
`training.cascade`) over those cached answers, item by item, so each row is what the strategy would have
answered with those samples, and costs what drawing them cost (each request's measured seconds and tokens).

Protocol: every choice is made on the train split (which member is "best", the cascade's threshold for a target
accuracy, consistency selection's tie-break priors); the test split is only reported. Rows: each member greedy;
each member's self-consistency at k = 4 and 8 (where cached) and adaptive (batches of 4, Beta rule, up to the
largest k); the vote over both members' samples; consistency-based selection; the agreement cascade at fixed
thresholds and at the fitted one; the oracle (some member's greedy answer is right). Columns: accuracy with its
Wilson interval; the difference from the best member's greedy accuracy (paired bootstrap interval, McNemar's
p); samples, tokens and seconds per item; the share of items the larger model answered.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from chorus.clients import eval_stats as S
from chorus.ensembles.voting import agreement, from_answers, settled, tally
from chorus.training.cascade import fit_thresholds, same


@dataclass
class Batch:
    answers: list[str]
    tokens: float  # completion tokens of the batch
    seconds: float


@dataclass
class Item:
    reference: str
    greedy: dict[str, Batch] = field(default_factory=dict)
    samples: dict[str, list[Batch]] = field(default_factory=dict)  # in seed order


@dataclass
class Outcome:
    right: bool
    samples: int
    tokens: float
    seconds: float
    large: bool = False  # the larger model was asked


def load(cache: Path, split: str, models: list[str]) -> dict[int, Item]:
    items: dict[int, Item] = {}
    for m in models:
        path = cache / split / f"{m}.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
        for r in sorted(rows, key=lambda r: (r["item"], r["seed"] or -1)):
            it = items.setdefault(r["item"], Item(r["reference"]))
            b = Batch([c["answer"] for c in r["choices"]], sum(c["tokens"] for c in r["choices"]), r["seconds"])
            if r["kind"] == "greedy":
                it.greedy[m] = b
            else:
                it.samples.setdefault(m, []).append(b)
    return items


def complete(items: dict[int, Item], need: dict[str, int]) -> dict[int, Item]:
    """Items where each model has its greedy answer and ``need[model]`` samples."""
    return {i: it for i, it in items.items() if all(
        m in it.greedy and sum(len(b.answers) for b in it.samples.get(m, [])) >= k for m, k in need.items())}


def first(it: Item, m: str, k: int) -> tuple[list[str], float, float]:
    """The first ``k`` samples of ``m``: answers, tokens, seconds (whole batches: they were drawn together)."""
    answers: list[str] = []
    tokens = seconds = 0.0
    for b in it.samples[m]:
        if len(answers) >= k:
            break
        answers += b.answers
        tokens += b.tokens
        seconds += b.seconds
    return answers[:k], tokens, seconds


def majority(answers: list[str]) -> str:
    return tally(from_answers(answers)).winner


def greedy(m: str) -> Callable[[Item], Outcome]:
    return lambda it: Outcome(same(it.greedy[m].answers[0], it.reference), 1, it.greedy[m].tokens,
                              it.greedy[m].seconds, large=False)


def self_consistency(m: str, k: int) -> Callable[[Item], Outcome]:
    def run(it: Item) -> Outcome:
        answers, tokens, seconds = first(it, m, k)
        return Outcome(same(majority(answers), it.reference), k, tokens, seconds)
    return run


def adaptive(m: str, k: int, rule: str = "beta") -> Callable[[Item], Outcome]:
    def run(it: Item) -> Outcome:
        answers: list[str] = []
        tokens = seconds = 0.0
        for b in it.samples[m]:
            answers += b.answers
            tokens += b.tokens
            seconds += b.seconds
            if len(answers) >= k or settled(tally(from_answers(answers)), k - len(answers), rule)[0]:
                break
        return Outcome(same(majority(answers[:k]), it.reference), len(answers[:k]), tokens, seconds)
    return run


def vote(ks: dict[str, int]) -> Callable[[Item], Outcome]:
    def run(it: Item) -> Outcome:
        answers: list[str] = []
        tokens = seconds = 0.0
        for m, k in ks.items():
            a, t, s = first(it, m, k)
            answers += a
            tokens += t
            seconds += s
        return Outcome(same(majority(answers), it.reference), len(answers), tokens, seconds, large=True)
    return run


def select(ks: dict[str, int], prior: dict[str, float]) -> Callable[[Item], Outcome]:
    def run(it: Item) -> Outcome:
        stats = []
        tokens = seconds = 0.0
        for m, k in ks.items():
            a, t, s = first(it, m, k)
            tokens += t
            seconds += s
            share, answer = agreement(from_answers(a))
            stats.append((share, prior.get(m, 0.0), answer))
        share, _, answer = max(stats, key=lambda x: (x[0], x[1]))  # ties: the higher prior, then the earlier
        return Outcome(same(answer, it.reference), sum(ks.values()), tokens, seconds, large=True)
    return run


def cascade(small: str, large: str, k: int, tau: float, last: str = "sc") -> Callable[[Item], Outcome]:
    def run(it: Item) -> Outcome:
        a, tokens, seconds = first(it, small, k)
        share, answer = agreement(from_answers(a))
        if share >= tau:
            return Outcome(same(answer, it.reference), k, tokens, seconds)
        if last == "greedy":
            g = it.greedy[large]
            return Outcome(same(g.answers[0], it.reference), k + 1, tokens + g.tokens, seconds + g.seconds, True)
        b, t2, s2 = first(it, large, k)
        return Outcome(same(majority(b), it.reference), 2 * k, tokens + t2, seconds + s2, True)
    return run


def score(items: dict[int, Item], row: Callable[[Item], Outcome]) -> list[Outcome]:
    return [row(items[i]) for i in sorted(items)]


def accuracy(items: dict[int, Item], row: Callable[[Item], Outcome]) -> float:
    out = score(items, row)
    return float(np.mean([o.right for o in out])) if out else 0.0


def main(args: argparse.Namespace) -> int:
    small, large = args.small, args.large
    need = {small: args.k_small, large: args.k_large}
    train = complete(load(Path(args.cache), "train", [small, large]), need)
    test = complete(load(Path(args.cache), "test", [small, large]), need)
    if not train or not test:
        raise SystemExit(f"need cached train and test items with greedy + {need} samples in {args.cache}")
    # choices on train only
    best = max((small, large), key=lambda m: accuracy(train, greedy(m)))
    prior = {m: accuracy(train, self_consistency(m, 4)) for m in (small, large)}
    rows_train = [{"members": [first(it, small, 4)[0], first(it, large, 4)[0]], "reference": it.reference}
                  for it in train.values()]
    target = accuracy(train, self_consistency(large, 4)) * args.keep
    fit = fit_thresholds(rows_train, target)
    rows: list[tuple[str, Callable[[Item], Outcome]]] = [(f"{small} greedy", greedy(small)),
                                                          (f"{large} greedy", greedy(large))]
    for m, kmax in ((small, args.k_small), (large, args.k_large)):
        rows += [(f"{m} self-consistency k={k}", self_consistency(m, k)) for k in (4, 8, 16) if k <= kmax]
        if kmax > 4:
            rows.append((f"{m} adaptive (Beta rule, batches of 4, k<={kmax})", adaptive(m, kmax)))
    rows += [
        (f"vote: {small} k={args.k_small} + {large} k={args.k_large}", vote(need)),
        (f"vote: {small} k=4 + {large} k=4", vote({small: 4, large: 4})),
        (f"consistency_select: k=4 each (ties: train accuracy {prior[small]:.2f} / {prior[large]:.2f})",
         select({small: 4, large: 4}, prior)),
    ]
    rows += [(f"agreement cascade tau={tau:g}, k=4 each", cascade(small, large, 4, tau)) for tau in (0.5, 0.75, 1.0)]
    rows.append((f"agreement cascade, tau fitted on train ({fit.thresholds[0]:g}; target {target:.3f})",
                 cascade(small, large, 4, fit.thresholds[0])))
    rows.append((f"agreement cascade tau=1 -> {large} greedy", cascade(small, large, 4, 1.0, last="greedy")))
    base = np.array([o.right for o in score(test, greedy(best))], dtype=float)
    oracle = np.array([any(same(it.greedy[m].answers[0], it.reference) for m in (small, large))
                       for _, it in sorted(test.items())], dtype=float)
    lines = [f"chorus bench answers: GSM8K test, n={len(test)} items (choices on train, n={len(train)}); best member "
             f"on train: {best} greedy", "",
             f"| row | accuracy [95% CI] | vs {best} greedy [95% CI] | McNemar p | samples / item | tokens / item | "
             "seconds / item | larger model asked |", "|---|---|---|---:|---:|---:|---:|---:|"]
    figure = []
    for label, row in rows:
        out = score(test, row)
        right = np.array([o.right for o in out], dtype=float)
        lo, hi = S.accuracy_interval(right)
        d = S.paired_difference(right, base)
        secs = float(np.mean([o.seconds for o in out]))
        lines.append(f"| {label} | {100 * right.mean():.1f} [{100 * lo:.1f}, {100 * hi:.1f}] | {100 * d.delta:+.1f} "
                     f"[{100 * d.low:+.1f}, {100 * d.high:+.1f}] | {d.p_mcnemar:.3g} | "
                     f"{np.mean([o.samples for o in out]):.1f} | {np.mean([o.tokens for o in out]):.0f} | {secs:.1f} | "
                     f"{100 * np.mean([o.large for o in out]):.0f}% |")
        figure.append({"row": label, "accuracy": float(right.mean()), "ci": [lo, hi], "seconds": secs,
                       "single": not any(o.large for o in out) or label.startswith(large)})
    lo, hi = S.accuracy_interval(oracle)
    lines.append(f"| oracle: some member's greedy answer is right | {100 * oracle.mean():.1f} [{100 * lo:.1f}, "
                 f"{100 * hi:.1f}] | | | | | | |")
    print("\n".join(lines))
    if args.figure_data:
        Path(args.figure_data).write_text(json.dumps({"n": len(test), "rows": figure}, indent=1) + "\n")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache", default="docs/data/gsm8k", help="chorus eval gsm8k's answer cache")
    p.add_argument("--small", default="qwen2.5-coder-0.5b-instruct-llama")
    p.add_argument("--large", default="qwen2.5-coder-1.5b-instruct-llama")
    p.add_argument("--k-small", type=int, default=8, help="samples of the small model per item in the cache")
    p.add_argument("--k-large", type=int, default=4, help="samples of the large model per item in the cache")
    p.add_argument("--keep", type=float, default=1.0, help="cascade fit: share of the large model's train accuracy")
    p.add_argument("--figure-data", help="write accuracy and seconds per row (JSON) for the figure")


