"""`chorus bench answers`: the answer-side ensembles on GSM8K, from the answers `chorus eval gsm8k` cached.

Every answer was drawn through chorus's API; this bench replays the served strategies' decision functions
(`ensembles.answers.votes`, the cascade fit of `training.cascade`) over those cached answers, item by item: each
row is what the strategy would have answered with those samples, at what drawing them cost. Answers cut at the
cache's cap are made whole with their continuations to 768 tokens (`chorus eval gsm8k-continue`).

Protocol: every choice is made on the train split (which member is "best", the cascade's threshold for a target
accuracy, consistency selection's tie-break priors); the test split is only reported. Rows: each member greedy;
each member's self-consistency at k = 4 and 8 (where cached) and adaptive (batches of 4, Beta rule, up to the
largest k); the vote over both members' samples; consistency-based selection; the agreement cascade at fixed
thresholds and at the fitted one; the oracle. Columns: accuracy (Wilson interval); the difference from the best
member's greedy (paired bootstrap, McNemar's p); samples, tokens, seconds per item; the larger model's share.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from chorus import stats as S
from chorus.clients.eval_gsm8k import read
from chorus.clients.eval_gsm8k_continue import continued_path, whole
from chorus.ensembles.answers.extract import extract_answer
from chorus.ensembles.answers.votes import Sample, Unfinished, agreement, from_answers, settled, tally
from chorus.ensembles.strategies.consistency_select import choose
from chorus.training.cascade import fit_thresholds, same
from chorus.training.verifier import read_scores, row_samples


@dataclass
class Batch:
    answers: list[str]
    tokens: float  # completion tokens of the batch (whole answers: continued ones with their continuation)
    seconds: float  # what the row is charged: measured, or modeled from the tokens (`model_seconds`)
    measured: float = 0.0  # the request's wall time as cached
    finished: list[bool] = field(default_factory=list)  # per answer: ended on its own (False: cut at max_tokens)
    drawn: float = 0.0  # the tokens the request drew (what ``measured`` is for; less than ``tokens`` if continued)
    samples: list[Sample] = field(default_factory=list)  # the answers as samples (text, token numbers if scored)


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


def load(cache: Path, split: str, models: list[str], budget: int | None = 768, scored: bool = True,
         reread: bool = True) -> dict[int, Item]:
    """The cached items of ``split``; with ``budget``, every answer cut at the cache's cap made whole with its
    continuation to that budget (`chorus eval gsm8k-continue`), and the token numbers of scored answers
    (`chorus eval gsm8k-score`) on its samples unless ``scored`` is False. With ``reread``, each answer is read
    from its text by today's extractor (ensembles/answers/extract.py), not taken as it was extracted when drawn."""
    items: dict[int, Item] = {}
    for m in models:
        path = cache / split / f"{m}.jsonl"
        rows = read(path)
        scores = {}
        if budget is not None:
            rows = whole(rows, read(continued_path(cache, split, m)), budget)
            scores = read_scores(cache, split, m, budget) if scored else {}
        for r in sorted(rows, key=lambda r: (r["item"], r["seed"] or -1)):
            it = items.setdefault(r["item"], Item(r["reference"]))
            answers = [extract_answer(c["text"]) if reread and "text" in c else c["answer"] for c in r["choices"]]
            b = Batch(answers, sum(c["tokens"] for c in r["choices"]), r["seconds"],
                      r["seconds"], [c.get("finish_reason", "stop") != "length" for c in r["choices"]],
                      sum(c.get("drawn_tokens", c["tokens"]) for c in r["choices"]), row_samples(r, m, scores))
            if r["kind"] == "greedy":
                it.greedy[m] = b
            else:
                it.samples.setdefault(m, []).append(b)
    return items


def complete(items: dict[int, Item], need: dict[str, int]) -> dict[int, Item]:
    """Items where each model has its greedy answer and ``need[model]`` samples."""
    return {i: it for i, it in items.items() if all(
        m in it.greedy and sum(len(b.answers) for b in it.samples.get(m, [])) >= k for m, k in need.items())}


def _requests(items: dict[int, Item], m: str, kind: str) -> list[Batch]:
    if kind == "greedy":
        return [it.greedy[m] for it in items.values() if m in it.greedy]
    return [b for it in items.values() for b in it.samples.get(m, [])]


def model_seconds(quiet: dict[int, Item], every: list[dict[int, Item]], models: list[str]) -> list[str]:
    """Charge every request the seconds a quiet machine takes for its tokens: per model and kind (greedy, a batch
    of samples), ``seconds = a + b * tokens per choice`` by least squares on the requests of ``quiet`` (drawn on
    an otherwise idle machine), applied to the requests of ``every``. Returns a line per fit: its size, R², mean
    relative error, and the median measured / modeled ratio of the other requests (what sharing the machine
    added)."""
    notes = []
    for m in models:
        for kind in ("greedy", "sample"):
            fit = _requests(quiet, m, kind)
            if len(fit) < 3:
                raise SystemExit(f"chorus bench answers: {len(fit)} quiet {kind} requests of {m} to fit seconds on; "
                                 "give --quiet-items or --seconds measured")
            x = np.array([[1.0, (b.drawn or b.tokens) / len(b.answers)] for b in fit])
            y = np.array([b.measured for b in fit])
            coef = np.linalg.lstsq(x, y, rcond=None)[0]
            pred = x @ coef
            r2 = 1 - float(((y - pred) ** 2).sum() / max(1e-12, ((y - y.mean()) ** 2).sum()))
            ids = {id(b) for b in fit}
            rest = [b for items in every for b in _requests(items, m, kind) if id(b) not in ids]
            for items in every:
                for b in _requests(items, m, kind):
                    b.seconds = max(0.0, float(coef[0] + coef[1] * b.tokens / len(b.answers)))
            ratio = (f"; the {len(rest)} others took {float(np.median([b.measured / b.seconds for b in rest])):.2f}x "
                     "the modeled seconds (median)" if rest else "")
            notes.append(f"{m} {kind}: {coef[0]:.2f} s + {1000 * coef[1]:.1f} ms/token, fitted on {len(fit)} quiet "
                         f"requests (R^2 {r2:.3f}, mean error {100 * float(np.mean(abs(y - pred) / y)):.1f}%){ratio}")
    return notes


def draw(it: Item, m: str, k: int, until: Callable[[list[Sample]], bool] | None = None
         ) -> tuple[list[Sample], float, float]:
    """The first ``k`` samples of ``m`` (whether each finished or was cut at max_tokens), their tokens and seconds
    (whole batches: they were drawn together); with ``until``, no batch after the one whose samples so far it
    accepts (adaptive sampling's stop)."""
    samples: list[Sample] = []
    tokens = seconds = 0.0
    for b in it.samples[m]:
        if len(samples) >= k:
            break
        samples += b.samples or from_answers(b.answers, m, b.finished or None)
        tokens += b.tokens
        seconds += b.seconds
        if until is not None and until(samples):
            break
    return samples[:k], tokens, seconds


def first(it: Item, m: str, k: int) -> tuple[list[str], float, float]:
    """`draw`'s answers alone (every one voting, finished or not: the online replay's arms)."""
    samples, tokens, seconds = draw(it, m, k)
    return [s.answer for s in samples], tokens, seconds


def majority(answers: list[str]) -> str:
    return tally(from_answers(answers)).winner


def greedy(m: str) -> Callable[[Item], Outcome]:
    return lambda it: Outcome(same(it.greedy[m].answers[0], it.reference), 1, it.greedy[m].tokens,
                              it.greedy[m].seconds, large=False)


def self_consistency(m: str, k: int, u: Unfinished = "abstain") -> Callable[[Item], Outcome]:
    def run(it: Item) -> Outcome:
        samples, tokens, seconds = draw(it, m, k)
        return Outcome(same(tally(samples, unfinished=u).winner, it.reference), k, tokens, seconds)
    return run


def adaptive(m: str, k: int, rule: str = "beta", u: Unfinished = "abstain") -> Callable[[Item], Outcome]:
    def run(it: Item) -> Outcome:
        samples, tokens, seconds = draw(it, m, k, lambda s: settled(tally(s, unfinished=u), k - len(s), rule)[0])
        return Outcome(same(tally(samples, unfinished=u).winner, it.reference), len(samples), tokens, seconds)
    return run


def vote(ks: dict[str, int], weights: dict[str, float] | None = None, u: Unfinished = "abstain"
         ) -> Callable[[Item], Outcome]:
    """Every member's first k samples in one tally (each counting its member's weight); a tie goes to the answer
    seen first, so list the member to trust on ties first."""
    def run(it: Item) -> Outcome:
        samples: list[Sample] = []
        tokens = seconds = 0.0
        for m, k in ks.items():
            a, t, s = draw(it, m, k)
            samples += a
            tokens += t
            seconds += s
        winner = tally(samples, weights, u).winner
        return Outcome(same(winner, it.reference), len(samples), tokens, seconds, large=True)
    return run


WEIGHTS = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)


def fit_weight(train: dict[int, Item], ks: dict[str, int], member: str, u: Unfinished = "abstain") -> float:
    """The weight of ``member``'s samples (the others count 1) with the best train accuracy; the smallest on a tie."""
    return max(WEIGHTS, key=lambda w: (accuracy(train, vote(ks, {member: w}, u)), -w))


def select(ks: dict[str, int], prior: dict[str, float], u: Unfinished = "abstain") -> Callable[[Item], Outcome]:
    """The served `consistency_select` decision (`choose`) over each member's first k samples."""
    def run(it: Item) -> Outcome:
        stats = []
        tokens = seconds = 0.0
        for m, k in ks.items():
            a, t, s = draw(it, m, k)
            tokens += t
            seconds += s
            stats.append((m, *agreement(a, tally(a, unfinished=u))))
        label, _ = choose(stats, prior)
        answer = next(x[2] for x in stats if x[0] == label)
        return Outcome(same(answer, it.reference), sum(ks.values()), tokens, seconds, large=True)
    return run


def cascade(small: str, large: str, k: int, tau: float, last: str = "sc", u: Unfinished = "abstain",
            k_large: int = 4) -> Callable[[Item], Outcome]:
    """``small``'s first k samples; below ``tau`` agreement, ``large``'s k_large-sample vote (or its greedy)."""
    def run(it: Item) -> Outcome:
        a, tokens, seconds = draw(it, small, k)
        share, answer = agreement(a, tally(a, unfinished=u))
        if share >= tau:
            return Outcome(same(answer, it.reference), k, tokens, seconds)
        if last == "greedy":
            g = it.greedy[large]
            return Outcome(same(g.answers[0], it.reference), k + 1, tokens + g.tokens, seconds + g.seconds, True)
        b, t2, s2 = draw(it, large, k_large)
        return Outcome(same(tally(b, unfinished=u).winner, it.reference), k + k_large, tokens + t2, seconds + s2,
                       True)
    return run


def cascade_curve(items: dict[int, Item], small: str, large: str, k: int, u: Unfinished
                  ) -> list[dict[str, Any]]:
    """Accuracy against the share of items sent to the larger model at every agreement threshold of ``small``'s
    k samples (0: never escalate .. 1: escalate unless all k agree; above 1: always), the larger model answering
    with its 4-sample vote or its greedy answer."""
    out: list[dict[str, Any]] = []
    for tau in [j / k for j in range(k + 1)] + [1 + 1 / k]:
        row: dict[str, Any] = {"tau": tau}
        for last in ("sc", "greedy"):
            got = score(items, cascade(small, large, k, tau, last=last, u=u))
            right = np.array([o.right for o in got], dtype=float)
            row[last], row[last + "_ci"] = float(right.mean()), list(S.accuracy_interval(right))
            row["share"] = float(np.mean([o.large for o in got]))
        out.append(row)
    return out


def ceilings(small: str, large: str, need: dict[str, int]) -> list[tuple[str, Callable[[Item], list[str]]]]:
    """What some answer of a set gets right: the pass@k ceilings a selection among those answers is under."""
    def of(m: str, k: int, with_greedy: bool = False) -> Callable[[Item], list[str]]:
        return lambda it: first(it, m, k)[0] + (it.greedy[m].answers if with_greedy else [])

    return [(f"{m} samples (k={need[m]})", of(m, need[m])) for m in (small, large)] + [
        (f"{m} samples + its greedy answer", of(m, need[m], True)) for m in (small, large)] + [
        ("every answer of both models", lambda it: of(small, need[small], True)(it) + of(large, need[large], True)(it))]


def score(items: dict[int, Item], row: Callable[[Item], Outcome]) -> list[Outcome]:
    return [row(items[i]) for i in sorted(items)]


def accuracy(items: dict[int, Item], row: Callable[[Item], Outcome]) -> float:
    out = score(items, row)
    return float(np.mean([o.right for o in out])) if out else 0.0


def main(args: argparse.Namespace) -> int:
    small, large = args.small, args.large
    need = {small: args.k_small, large: args.k_large}
    # the samples' scores are left out here (ties go to the answer seen first, on every item alike): what reading
    # them adds is `chorus bench confidence`'s, on the items that are scored
    budget = args.budget or None
    reread = not args.stored_answers
    train = complete(load(Path(args.cache), "train", [small, large], budget, scored=False, reread=reread), need)
    test = complete(load(Path(args.cache), "test", [small, large], budget, scored=False, reread=reread), need)
    if not train or not test:
        raise SystemExit(f"need cached train and test items with greedy + {need} samples in {args.cache}")
    notes = []
    if args.seconds == "modeled":
        quiet = {i: it for i, it in test.items() if i < args.quiet_items}
        notes = ["Seconds modeled from each request's tokens (`--seconds modeled`):"] + [
            f"- {n}" for n in model_seconds(quiet, [train, test], [small, large])] + [""]
    # choices on train only
    u: Unfinished = args.unfinished
    best = max((small, large), key=lambda m: accuracy(train, greedy(m)))
    prior = {m: accuracy(train, self_consistency(m, 4, u)) for m in (small, large)}
    drawn = [(draw(it, small, 4)[0], draw(it, large, 4)[0], it.reference) for it in train.values()]
    rows_train = [{"members": [[s.answer for s in a] for a in (x, y)],
                   "finished": [[not s.cut for s in a] for a in (x, y)], "reference": ref}
                  for x, y, ref in drawn]
    target = accuracy(train, self_consistency(large, 4, u)) * args.keep
    fit = fit_thresholds(rows_train, target, unfinished=u)
    target_g = accuracy(train, greedy(large)) * args.keep  # the goal's reference: the larger model's greedy answer
    fit_g = fit_thresholds(rows_train, target_g, unfinished=u)
    rows: list[tuple[str, Callable[[Item], Outcome]]] = [(f"{small} greedy", greedy(small)),
                                                          (f"{large} greedy", greedy(large))]
    for m, kmax in ((small, args.k_small), (large, args.k_large)):
        rows += [(f"{m} self-consistency k={k}", self_consistency(m, k, u)) for k in (4, 8, 16) if k <= kmax]
        if kmax > 4:
            rows.append((f"{m} adaptive (Beta rule, batches of 4, k<={kmax})", adaptive(m, kmax, u=u)))
    # the vote lists the better member on train first: a tie goes to the answer seen first
    other = small if best == large else large
    both = {best: need[best], other: need[other]}
    w = fit_weight(train, both, best, u)
    rows += [
        (f"vote: {small} k={args.k_small} + {large} k={args.k_large}", vote(both, u=u)),
        (f"vote: {small} k=4 + {large} k=4", vote({best: 4, other: 4}, u=u)),
        (f"vote: {small} k={args.k_small} + {large} k={args.k_large}, {best} weighted {w:g} (fitted on train)",
         vote(both, {best: w}, u)),
        (f"consistency_select: k=4 each (ties: train accuracy {prior[small]:.2f} / {prior[large]:.2f})",
         select({small: 4, large: 4}, prior, u)),
    ]
    rows += [(f"agreement cascade tau={tau:g}, k=4 each", cascade(small, large, 4, tau, u=u))
             for tau in (0.5, 0.75, 1.0)]
    rows.append((f"agreement cascade, tau fitted on train for {large}'s greedy accuracy ({fit_g.thresholds[0]:g}; "
                 f"target {target_g:.3f})", cascade(small, large, 4, fit_g.thresholds[0], u=u)))
    rows.append((f"agreement cascade, tau fitted on train ({fit.thresholds[0]:g}; target {target:.3f})",
                 cascade(small, large, 4, fit.thresholds[0], u=u)))
    rows.append((f"agreement cascade tau=1 -> {large} greedy", cascade(small, large, 4, 1.0, last="greedy", u=u)))
    base = np.array([o.right for o in score(test, greedy(best))], dtype=float)
    oracle = np.array([any(same(it.greedy[m].answers[0], it.reference) for m in (small, large))
                       for _, it in sorted(test.items())], dtype=float)
    made = f"answers cut at the cache's cap continued to {budget} tokens" if budget else "answers as drawn"
    lines = [f"chorus bench answers: {args.name} test, n={len(test)} items (choices on train, n={len(train)}); best "
             f"member on train: {best} greedy; {made}", "", *notes,
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
    lines += ["", f"Ceilings (pass@k: some answer right), n = {len(test)}:", ""] + [
        f"- {name}: {100 * float(np.mean([any(same(a, it.reference) for a in pick(it)) for it in test.values()])):.1f}%"
        for name, pick in ceilings(small, large, need)]
    lines += ["", "Each model's self-consistency against its own greedy answer (goal 1):", ""]
    for m, kmax in ((small, args.k_small), (large, args.k_large)):
        own = np.array([o.right for o in score(test, greedy(m))], dtype=float)
        for k in (4, 8, 16):
            if k <= kmax:
                d = S.paired_difference(np.array([o.right for o in score(test, self_consistency(m, k, u))],
                                                 dtype=float), own)
                lines.append(f"- {m} k={k}: {100 * d.delta:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}], "
                             f"McNemar p = {d.p_mcnemar:.3g}")
    curve = cascade_curve(test, small, large, args.k_small, u)
    lines += ["", f"The agreement cascade's whole curve: tau, the share of {small}'s {args.k_small} samples that must "
              f"agree (above 1: always escalate); below it {large} answers:", "",
              f"| tau | sent to {large} | accuracy, then its 4-sample vote [95% CI] | accuracy, then its greedy "
              "[95% CI] |", "|---:|---:|---|---|"]
    for c in curve:
        lines.append(f"| {c['tau']:.3g} | {100 * c['share']:.0f}% | " + " | ".join(
            f"{100 * c[k]:.1f} [{100 * c[k + '_ci'][0]:.1f}, {100 * c[k + '_ci'][1]:.1f}]" for k in ("sc", "greedy"))
            + " |")
    print("\n".join(lines))
    if args.figure_data:
        Path(args.figure_data).write_text(json.dumps({"set": args.name, "n": len(test), "seconds": args.seconds,
                                                      "rows": figure, "cascade_curve": curve}, indent=1) + "\n")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache", default="docs/data/gsm8k", help="chorus eval gsm8k's answer cache")
    p.add_argument("--small", default="qwen2.5-coder-0.5b-instruct-llama")
    p.add_argument("--large", default="qwen2.5-coder-1.5b-instruct-llama")
    p.add_argument("--k-small", type=int, default=8, help="samples of the small model per item in the cache")
    p.add_argument("--k-large", type=int, default=4, help="samples of the large model per item in the cache")
    p.add_argument("--keep", type=float, default=1.0, help="cascade fit: share of the large model's train accuracy")
    p.add_argument("--figure-data", help="write accuracy and seconds per row (JSON) for the figure")
    p.add_argument("--budget", type=int, default=768, help="answers cut at the cache's cap made whole with "
                   "their continuations to this budget (0: as drawn)")
    p.add_argument("--name", default="GSM8K", help="the set's name in the table's title")
    p.add_argument("--stored-answers", action="store_true", help="the answers as extracted when drawn (a set with a "
                   "rule of its own, such as the addition set's first number), not read again from the texts")
    p.add_argument("--unfinished", choices=["abstain", "vote"], default="abstain", help="samples cut at max_tokens: "
                   "abstain while another sample finished (the served default), or vote")
    p.add_argument("--seconds", choices=["modeled", "measured"], default="modeled",
                   help="charge each request its measured wall time, or the seconds a quiet machine takes for its "
                        "tokens (fitted per model and kind on the test items below --quiet-items)")
    p.add_argument("--quiet-items", type=int, default=30,
                   help="test items drawn on an otherwise idle machine (0 .. N-1): what --seconds modeled fits on")


