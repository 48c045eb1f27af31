"""`chorus bench gate`: the answer vote that samples only where it pays, replayed over the cached GSM8K answers, by
cost: accuracy against generated tokens and modeled seconds per item for one model's rows (greedy, the majority
of its greedy answer + k samples, and the served gate: ``answer_vote`` with ``greedy: true``, ``gate``,
``gate_by`` and a ``stop`` rule, at every threshold of a grid), each with its Wilson interval and McNemar's p
against greedy, and which rows are on the Pareto front (no other row at most as costly is more accurate).

The gate is replayed with the served decision functions: the greedy answer's confidence by `ensembles.answers.decide
.sample_confidence`, the stop by `ensembles.answers.votes.settled`, the vote by
`ensembles.answers.decide.decide` (ties by mean log-probability, as served). Samples are taken in seed order, one
batch at a time; a sample is charged its share of its cached request's tokens and seconds.

Protocol (the evidence issue's pre-registration): the train split is read freely; the test split only with
``--preregistered FILE``, a file committed before the run (the rows it names are the headline; every other row is
printed too, marked exploratory). Thresholds are quantiles of the train split's greedy confidences, so the grid
itself is fixed on train. ``--write-preregistration FILE`` writes that file from train (at least 100 items) by a
rule fixed here before the train split was complete (`choose`: the cheapest gated row within a point of the
majority's train accuracy).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from chorus import stats as S
from chorus.bench.answers import Item, Outcome, complete, greedy, load, score
from chorus.ensembles.answers.confidence import MEASURES, measure, stop_at
from chorus.ensembles.answers.decide import Rule, decide, sample_confidence
from chorus.ensembles.answers.votes import Sample, settled, tally
from chorus.training.cascade import same

QUANTILES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)


@dataclass(frozen=True)
class Gate:
    """One served configuration: ``answer_vote`` with ``greedy: true`` and these fields."""

    by: str
    threshold: float | None  # None: no gate (the samples are always drawn)
    stop: str = "none"
    batch: int = 4
    trace_stop: float | None = None  # DeepConf's online stop (``trace_stop``, window 64): None: every sample whole

    def label(self) -> str:
        gate = "no gate" if self.threshold is None else f"gate {self.by} >= {self.threshold:.3g}"
        online = "" if self.trace_stop is None else f", trace_stop {self.trace_stop:.3g}"
        return f"{gate}, stop {self.stop}, batch {self.batch}{online}"


def shares(it: Item, m: str) -> list[tuple[Sample, float, float]]:
    """``m``'s samples in seed order, each with its share (by its tokens) of its request's tokens and seconds."""
    out = []
    for b in it.samples[m]:
        weights = [max(s.tokens, 1) for s in b.samples]
        total = float(sum(weights))
        out += [(s, b.tokens * w / total, b.seconds * w / total) for s, w in zip(b.samples, weights)]
    return out


TRACE_WINDOW = 64  #: the served ``window`` the online stop is replayed with


def stopped(s: Sample, tokens: float, seconds: float, threshold: float | None) -> tuple[Sample, float, float]:
    """A sample as DeepConf's online stop would have left it (`confidence.stop_at`, the served rule): cut where its
    window's confidence fell below ``threshold``, charged the tokens and seconds it had by then, with no vote."""
    if threshold is None or s.per_token is None:
        return s, tokens, seconds
    at = stop_at(s.per_token.conf, TRACE_WINDOW, threshold)
    if at is None:
        return s, tokens, seconds
    part = at / max(s.tokens, 1)
    return dataclasses.replace(s, answer="", canonical="", finish_reason="confidence"), tokens * part, seconds * part


def online_grid(train: dict[int, Item], m: str, base: list[Gate]) -> list[Gate]:
    """DeepConf's online stop on each of ``base``'s rows, its threshold at the 0.1-0.3 quantiles of the train
    samples' lowest window (64 tokens): exploratory rows, never part of the pre-registered choice."""
    values = [measure(s.per_token, "lowest_window", TRACE_WINDOW) for it in train.values() for b in it.samples[m]
              for s in b.samples if s.per_token is not None]
    return [dataclasses.replace(g, trace_stop=float(np.quantile(values, q))) for g in base for q in (0.1, 0.2, 0.3)]


def gated_row(m: str, k: int, g: Gate) -> Callable[[Item], Outcome]:
    def run(it: Item) -> Outcome:
        head = it.greedy[m]
        first = head.samples[0]
        voters = [dataclasses.replace(first, greedy=True)]
        tokens, seconds = head.tokens, head.seconds
        c = sample_confidence(first, g.by) if g.threshold is not None else None
        if g.threshold is None or c is None or c < g.threshold:
            pool = [stopped(s, t, sec, g.trace_stop) for s, t, sec in shares(it, m)[:k]]
            for at in range(0, len(pool), g.batch):
                for s, t, sec in pool[at:at + g.batch]:
                    voters.append(s)
                    tokens += t
                    seconds += sec
                if settled(tally(voters), k - min(at + g.batch, k), g.stop)[0]:
                    break
        d = decide(voters, Rule(), None, "abstain", None, [m] * len(voters))
        return Outcome(same(d.answer, it.reference), len(voters) - 1, tokens, seconds)
    return run


def grid(train: dict[int, Item], m: str) -> list[Gate]:
    """No gate (stop none and agree), then each measure's train quantiles as thresholds, with stop none and agree."""
    gates = [Gate("mean_logprob", None, "none", 4), Gate("mean_logprob", None, "agree", 1)]
    for by in MEASURES:
        values = [c for it in train.values() if (c := sample_confidence(it.greedy[m].samples[0], by)) is not None]
        if not values:
            continue
        for q in QUANTILES:
            t = float(np.quantile(values, q))
            gates += [Gate(by, t, "none", 4), Gate(by, t, "agree", 1)]
    return gates


def committed(path: Path) -> str:
    """The commit that last changed ``path``, which must be committed as it is now; else exit saying why."""
    rel = str(path)
    changed = subprocess.run(["git", "status", "--porcelain", "--", rel], capture_output=True, text=True).stdout
    sha = subprocess.run(["git", "log", "-1", "--format=%h", "--", rel], capture_output=True, text=True).stdout.strip()
    if not sha or changed.strip():
        raise SystemExit(f"chorus bench gate: {rel} is not committed as it is: the test split is read only after the "
                         "pre-registration is in a commit")
    return sha


def table(items: dict[int, Item], m: str, k: int, gates: list[Gate], headline: set[str]) -> list[str]:
    first = score(items, greedy(m))
    base = np.array([o.right for o in first], dtype=float)
    rows = [(f"{m} greedy", first)] + [(g.label(), score(items, gated_row(m, k, g))) for g in gates]
    costs = [(float(np.mean([o.tokens for o in out])), float(np.mean([o.right for o in out]))) for _, out in rows]
    greedy_tokens = costs[0][0]
    lines = ["| row | accuracy [95% CI] | vs greedy [95% CI] | McNemar p | samples / item | tokens / item | "
             "x greedy's tokens | seconds / item | Pareto |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for (name, out), (tok, acc) in zip(rows, costs):
        right = np.array([o.right for o in out], dtype=float)
        lo, hi = S.accuracy_interval(right)
        d = S.paired_difference(right, base)
        front = not any(t <= tok and a > acc for t, a in costs)
        mark = ("**headline** " if name in headline else "") + ("yes" if front else "")
        lines.append(f"| {name} | {100 * acc:.1f} [{100 * lo:.1f}, {100 * hi:.1f}] | {100 * d.delta:+.1f} "
                     f"[{100 * d.low:+.1f}, {100 * d.high:+.1f}] | {d.p_mcnemar:.3g} | "
                     f"{np.mean([o.samples for o in out]):.2f} | {tok:.0f} | {tok / greedy_tokens:.2f} | "
                     f"{np.mean([o.seconds for o in out]):.1f} | {mark} |")
    return lines


MIN_TRAIN = 100  #: train items a pre-registration is written from (the evidence issue's floor)
WITHIN = 0.01  #: the chosen row may be this far below the train majority's accuracy


def choose(train: dict[int, Item], m: str, k: int, gates: list[Gate]) -> tuple[Gate, float, float]:
    """The pre-registered choice, a rule fixed in code before the train split was complete: among the gated rows,
    the one with the fewest generated tokens an item on train whose train accuracy is at least the majority's
    (greedy + k samples, no gate) minus `WITHIN`; ties to the earlier row of the grid. With its accuracy and
    tokens on train."""
    majority = float(np.mean([o.right for o in score(train, gated_row(m, k, gates[0]))]))
    best: tuple[float, int, Gate, float] | None = None
    for i, g in enumerate(gates):
        if g.threshold is None:
            continue
        out = score(train, gated_row(m, k, g))
        acc, tok = float(np.mean([o.right for o in out])), float(np.mean([o.tokens for o in out]))
        if acc >= majority - WITHIN and (best is None or (tok, i) < (best[0], best[1])):
            best = (tok, i, g, acc)
    if best is None:
        raise SystemExit("chorus bench gate: no gated row comes within 1 point of the majority on train")
    return best[2], best[3], best[0]


def preregister(path: Path, train: dict[int, Item], m: str, k: int, gates: list[Gate]) -> None:
    """Write the pre-registration (to be committed before the test split is read): the chosen row, its served
    fields and the headline, from train alone."""
    if len(train) < MIN_TRAIN:
        raise SystemExit(f"chorus bench gate: {len(train)} train items; a pre-registration is written from at least "
                         f"{MIN_TRAIN} (scripts/gsm8k-train-grow)")
    g, acc, tok = choose(train, m, k, gates)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    doc = {"model": m, "k": k, "train_items": len(train), "data_at": head,
           "rule": "the gated row with the fewest tokens per item on train whose train accuracy is at least the "
                   f"majority's (greedy + {k} samples) minus {100 * WITHIN:g} point; ties to the earlier row",
           "served": {"strategy": "answer_vote", "greedy": True, "samples": k, "gate": g.threshold,
                      "gate_by": g.by, "stop": g.stop, "batch": g.batch},
           "train": {"accuracy": acc, "tokens_per_item": tok},
           "headline": [g.label()]}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\nPre-registration written to {path}: commit it, then run with --preregistered {path}")


def figure(path: Path, m: str, k: int, gates: list[Gate], panels: list[tuple[str, dict[int, Item]]],
           headline: set[str]) -> None:
    """Accuracy against the greedy's tokens, one panel per split: every row (the gated ones coloured by measure),
    the Pareto front, the majority rows and the headline marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.4), squeeze=False)
    colours = dict(zip(MEASURES, ("C0", "C1", "C2", "C3", "C4"), strict=False))
    for ax, (title, items) in zip(axes[0], panels):
        first = score(items, greedy(m))
        base = float(np.mean([o.tokens for o in first]))
        points: list[tuple[str, Gate | None, float, float]] = [
            ("greedy", None, 1.0, 100 * float(np.mean([o.right for o in first])))]
        for g in gates:
            out = score(items, gated_row(m, k, g))
            points.append((g.label(), g, float(np.mean([o.tokens for o in out])) / base,
                           100 * float(np.mean([o.right for o in out]))))
        for by in MEASURES:
            xs = [(x, y, p.stop) for _, p, x, y in points if p is not None and p.threshold is not None and p.by == by]
            for stop, marker in (("none", "o"), ("agree", "^")):
                sel = [(x, y) for x, y, s in xs if s == stop]
                if sel:
                    ax.scatter(*zip(*sel), s=18, marker=marker, color=colours[by], alpha=0.7,
                               label=f"gate {by}, stop {stop}")
        front = sorted((x, y) for _, _, x, y in points if not any(x2 <= x and y2 > y for _, _, x2, y2 in points))
        ax.step(*zip(*front), where="post", color="black", linewidth=0.8, label="Pareto front")
        for label, p, x, y in points:
            if p is None or p.threshold is None:
                ax.scatter([x], [y], s=60, marker="s", color="black")
                ax.annotate("greedy" if p is None else f"majority, stop {p.stop}", (x, y), fontsize=7,
                            xytext=(4, -10), textcoords="offset points")
            if label in headline:
                ax.scatter([x], [y], s=220, marker="*", color="gold", edgecolor="black", zorder=5,
                           label="pre-registered headline")
        ax.axvline(2.5, color="grey", linestyle=":", linewidth=0.8)
        ax.set_title(f"{title} (n={len(items)})", fontsize=10)
        ax.set_xlabel("generated tokens, x the greedy's")
        ax.set_ylabel("accuracy, %")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=6, loc="lower right")
    fig.suptitle(f"GSM8K, {m}: the gate over greedy + up to {k} samples", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nFigure written to {path}")


def main(args: argparse.Namespace) -> int:
    cache, m, k = Path(args.cache), args.model, args.k
    train = {i: it for i, it in complete(load(cache, "train", [m]), {m: k}).items()
             if it.greedy[m].samples and all(s.per_token is not None for s in it.greedy[m].samples)}
    if not train:
        raise SystemExit(f"chorus bench gate: no scored train items of {m} in {cache}")
    gates = grid(train, m)
    print(f"chorus bench gate: GSM8K, {m}, greedy + up to {k} samples, answers made whole at 768 tokens; thresholds: "
          f"quantiles {', '.join(f'{q:g}' for q in QUANTILES)} of the train split's greedy confidences. Cost: "
          "generated tokens; seconds as measured (the train draws shared the machine with other work: a rough "
          "figure, not a cost to compare)")
    print(f"\nTrain (n={len(train)}):\n")
    print("\n".join(table(train, m, k, gates, set())))
    if args.write_preregistration:
        preregister(Path(args.write_preregistration), train, m, k, gates)
    if args.preregistered:
        pre = Path(args.preregistered)
        sha = committed(pre)
        headline = set(json.loads(pre.read_text()).get("headline", []))
        test = complete(load(cache, "test", [m]), {m: k})
        print(f"\nTest (n={len(test)}; pre-registered in {pre} at {sha}: the headline rows are marked, every other "
              "row is exploratory):\n")
        print("\n".join(table(test, m, k, gates, headline)))
    base = [gates[0], gates[1], *(g for g in gates if args.preregistered and g.label() in headline)]
    online = [*base, *online_grid(train, m, base)]
    print("\nDeepConf's online stop (`trace_stop`: a sample stopped once its last 64 tokens' mean confidence is below "
          "the threshold, the train samples' lowest-window quantiles 0.1-0.3; added after the pre-registration: "
          f"exploratory), train (n={len(train)}):\n")
    print("\n".join(table(train, m, k, online, set())))
    if args.preregistered:
        print(f"\nThe same, test (n={len(test)}; exploratory):\n")
        print("\n".join(table(test, m, k, online, set())))
    if args.figure:
        panels = [("train", train)] + ([("test, pre-registered", test)] if args.preregistered else [])
        figure(Path(args.figure), m, k, gates, panels, headline if args.preregistered else set())
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache", default="docs/data/gsm8k", help="the answer cache (continued and scored beside it)")
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct-llama")
    p.add_argument("--k", type=int, default=4, help="samples per item at most")
    p.add_argument("--preregistered", help="a committed pre-registration (JSON with 'headline': row labels): only "
                   "then is the test split read")
    p.add_argument("--figure", metavar="PNG", help="accuracy against tokens, train (and test with --preregistered)")
    p.add_argument("--write-preregistration", metavar="FILE", help="write the pre-registration from train (at least "
                   f"{MIN_TRAIN} items): the row `choose` picks, its served fields and the headline")
