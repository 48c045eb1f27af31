"""`chorus bench online`: the online router replayed on logged outcomes, against the arms it chooses among.

Logged outcomes: every arm's answer to every item, already drawn through chorus and cached: the GSM8K answers
of `chorus eval gsm8k` (greedy and sampled, both Qwen2.5-Coder models; arms: each model greedy, each model's
self-consistency vote, the agreement cascade) and the addition set's greedy answers (`bench selector`'s cache
format; arms: each model greedy). An arm's cost is its completion tokens at the given prices (per million
tokens); the reward the router learns is ``right - cost_weight * cost``, as served (``cost: price``).

Replay, per seed: ``--requests`` items drawn with replacement in a seeded order from the held-out split, each a
request: the router (`routers.bandit.OnlinePolicy`, the served code; features from the prompt's MiniLM embedding)
picks an arm, the logged outcome of that arm on that item is its answer, and the feedback (right or not) comes
at once. Reported against: every arm fixed, the best fixed arm in hindsight (on the held-out items), the
configured default arm, uniform random, the offline router (the same ridge regressions fitted on the training
split with every arm's outcome known, then greedy and frozen) and the oracle (the cheapest right arm). The
policy's parameters are chosen on the training split (a small grid, best mean reward after the first 300
requests); the held-out split is only reported. Intervals: 95% over seeds (t); the items repeat (n items,
many more requests), which flatters any learner that can recognise an item, and is said with the figures.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy import stats

from chorus.bench.answers import Item, complete, first, load, majority
from chorus.ensembles.answers.votes import agreement, from_answers
from chorus.ensembles.routers.bandit import LinearArm, OnlinePolicy, PolicyParams, features, projection
from chorus.training.cascade import same

SMALL, LARGE = "qwen2.5-coder-0.5b-instruct-llama", "qwen2.5-coder-1.5b-instruct-llama"


@dataclass
class Table:
    """Logged outcomes: ``right`` and ``cost`` (items, arms), and each item's prompt."""

    name: str
    arms: list[str]
    prompts: list[str]
    right: np.ndarray
    cost: np.ndarray

    def first(self, k: int) -> Table:
        """The same items with the first ``k`` arms only."""
        return Table(self.name, self.arms[:k], self.prompts, self.right[:, :k], self.cost[:, :k])

    def __add__(self, other: Table) -> Table:
        assert self.arms == other.arms
        return Table(f"{self.name} + {other.name}", self.arms, self.prompts + other.prompts,
                     np.vstack([self.right, other.right]), np.vstack([self.cost, other.cost]))


def gsm8k_arms(prices: dict[str, float], tau: float) -> list[tuple[str, Callable[[Item], tuple[bool, float]]]]:
    """The GSM8K arms: (label, item -> (right, cost)); the two greedy ones first."""
    def greedy(m: str) -> Callable[[Item], tuple[bool, float]]:
        return lambda it: (same(it.greedy[m].answers[0], it.reference), it.greedy[m].tokens * prices[m] / 1e6)

    def sc(m: str, k: int) -> Callable[[Item], tuple[bool, float]]:
        def run(it: Item) -> tuple[bool, float]:
            answers, tokens, _ = first(it, m, k)
            return same(majority(answers), it.reference), tokens * prices[m] / 1e6
        return run

    def cascade(it: Item) -> tuple[bool, float]:
        a, t1, _ = first(it, SMALL, 8)
        share, answer = agreement(from_answers(a))
        if share >= tau:
            return same(answer, it.reference), t1 * prices[SMALL] / 1e6
        b, t2, _ = first(it, LARGE, 4)
        return same(majority(b), it.reference), (t1 * prices[SMALL] + t2 * prices[LARGE]) / 1e6

    return [("0.5B greedy", greedy(SMALL)), ("1.5B greedy", greedy(LARGE)), ("0.5B vote k=8", sc(SMALL, 8)),
            ("1.5B vote k=4", sc(LARGE, 4)), (f"cascade 0.5B k=8 -> 1.5B k=4 (tau {tau:g})", cascade)]


def gsm8k_table(cache: Path, data: Path, split: str, prices: dict[str, float], tau: float,
                below: int | None = None) -> Table:
    """The split's items with every arm's answers cached (only items numbered below ``below``, if given)."""
    items = complete(load(cache, split, [SMALL, LARGE]), {SMALL: 8, LARGE: 4})
    items = {i: it for i, it in items.items() if below is None or i < below}
    questions = [json.loads(line)["question"] for line in (data / f"{split}.jsonl").read_text().splitlines()]
    arms = gsm8k_arms(prices, tau)
    rows = [[arm(items[i]) for _, arm in arms] for i in sorted(items)]
    return Table(f"GSM8K {split}", [a for a, _ in arms], [questions[i] for i in sorted(items)],
                 np.array([[r for r, _ in row] for row in rows], dtype=float),
                 np.array([[c for _, c in row] for row in rows], dtype=float))


def addition_tables(problems: Path, answers: Path, prices: dict[str, float]) -> tuple[Table, Table]:
    """The addition set's greedy answers (``answers/MODEL.jsonl``), split in two seeded halves."""
    items = [json.loads(line) for line in problems.read_text().splitlines()]
    got = {m: {r["id"]: r for r in map(json.loads, (answers / f"{m}.jsonl").read_text().splitlines())}
           for m in (SMALL, LARGE)}
    items = [it for it in items if all(it["id"] in got[m] for m in (SMALL, LARGE))]
    order = list(range(len(items)))
    random.Random(0).shuffle(order)
    halves = []
    for name, part in (("train", order[: len(order) // 2]), ("test", order[len(order) // 2:])):
        chosen = [items[i] for i in sorted(part)]
        right = [[got[m][it["id"]]["right"] for m in (SMALL, LARGE)] for it in chosen]
        # completion tokens: the record's total less the prompt, which a greedy answer of at most 12 tokens dwarfs;
        # the total is what was charged, so it is the cost
        cost = [[got[m][it["id"]]["usage_tokens"] * prices[m] / 1e6 for m in (SMALL, LARGE)] for it in chosen]
        halves.append(Table(f"addition {name}", ["0.5B greedy", "1.5B greedy"], [it["prompt"] for it in chosen],
                            np.array(right, dtype=float), np.array(cost, dtype=float)))
    return halves[0], halves[1]


# ---- replay -----------------------------------------------------------------------------------------------------

@dataclass
class Run:
    right: np.ndarray  # (seeds, requests)
    cost: np.ndarray
    explored: np.ndarray | None = None


@functools.cache
def embedded(prompts: tuple[str, ...], dims: int) -> np.ndarray:
    """(Cached: every cost weight of an environment replays the same prompts.)"""
    return embed(list(prompts), dims)


def embed(prompts: list[str], dims: int) -> np.ndarray:
    from chorus.ensembles.similarity import Embedder

    proj = projection(dims)
    return np.stack([features(e, proj) for e in Embedder.embed(prompts)])  # (items, d + 1)


def orders(n_items: int, requests: int, seeds: int) -> np.ndarray:
    return np.stack([np.random.default_rng(s).integers(n_items, size=requests) for s in range(seeds)])


def fixed(table: Table, order: np.ndarray, arm_of: Callable[[int, int], int]) -> Run:
    arms = np.array([[arm_of(s, i) for i in row] for s, row in enumerate(order)])
    return Run(table.right[order, arms], table.cost[order, arms])


def online(table: Table, x: np.ndarray, order: np.ndarray, params: PolicyParams, default: int,
           cost_weight: float) -> Run:
    right, cost, explored = (np.zeros(order.shape) for _ in range(3))
    for s, row in enumerate(order):
        policy, rng = OnlinePolicy(len(table.arms), x.shape[1], params, default), random.Random(s)
        for t, i in enumerate(row):
            d = policy.choose(x[i], rng)
            r, c = table.right[i, d.arm], table.cost[i, d.arm]
            policy.learn(d.arm, x[i], r - cost_weight * c)
            right[s, t], cost[s, t], explored[s, t] = r, c, d.explored
    return Run(right, cost, explored)


def offline(train: Table, x_train: np.ndarray, test: Table, x_test: np.ndarray, order: np.ndarray,
            cost_weight: float) -> Run:
    """Ridge regressions fitted on the training split with every arm's outcome (full information), frozen."""
    arms = [LinearArm(x_train.shape[1]) for _ in train.arms]
    reward = train.right - cost_weight * train.cost
    for i in range(len(train.prompts)):
        for a, arm in enumerate(arms):
            arm.learn(x_train[i], float(reward[i, a]))
    pick = [int(np.argmax([arm.score(x_test[i], 0.0)[0] for arm in arms])) for i in range(len(test.prompts))]
    return fixed(test, order, lambda _s, i: pick[i])


def always(arm: int) -> Callable[[int, int], int]:
    return lambda _s, _i: arm


def interval(per_seed: np.ndarray) -> tuple[float, float, float]:
    m = float(per_seed.mean())
    if len(per_seed) < 2:
        return m, m, m
    h = float(stats.t.ppf(0.975, len(per_seed) - 1) * per_seed.std(ddof=1) / np.sqrt(len(per_seed)))
    return m, m - h, m + h


def tune(train: Table, x: np.ndarray, requests: int, seeds: int, after: int, default: int,
         cost_weight: float) -> tuple[PolicyParams, list[str]]:
    """The policy's parameters with the best mean reward after ``after`` requests on the training split."""
    order = orders(len(train.prompts), requests, seeds)
    best, lines = None, []
    for alpha, warmup, explore in itertools.product((0.0, 0.1, 0.3), (10, 30), (0.1, 0.2)):
        p = PolicyParams(alpha=alpha, warmup=warmup, explore=explore)
        run = online(train, x, order, p, default, cost_weight)
        score = float((run.right - cost_weight * run.cost)[:, after:].mean())
        lines.append(f"alpha {alpha:g}, warmup {warmup}, explore {explore:g}: reward after {after} {score:.4f}")
        if best is None or score > best[0]:
            best = (score, p)
    assert best is not None
    return best[1], lines


def report(name: str, train: Table, test: Table, requests: int, seeds: int, after: int, cost_weight: float,
           dims: int) -> tuple[list[str], dict[str, object]]:
    x_train, x_test = embedded(tuple(train.prompts), dims), embedded(tuple(test.prompts), dims)
    train_reward = (train.right - cost_weight * train.cost).mean(0)
    default = int(np.argmax(train_reward))  # the best arm on train: what a deployment would configure
    params, grid = tune(train, x_train, requests, min(seeds, 5), after, default, cost_weight)
    order = orders(len(test.prompts), requests, seeds)
    test_reward = test.right - cost_weight * test.cost
    best = int(np.argmax(test_reward.mean(0)))
    oracle = [int(np.lexsort((test.cost[i], -test_reward[i]))[0]) for i in range(len(test.prompts))]
    k = len(test.arms)
    runs: dict[str, Run] = {f"{a} (fixed)": fixed(test, order, always(j)) for j, a in enumerate(test.arms)}
    runs.update({
        f"best fixed in hindsight: {test.arms[best]}": runs[f"{test.arms[best]} (fixed)"],
        "uniform random": fixed(test, order, lambda s, t: int(np.random.default_rng([s, t]).integers(k))),
        "offline router (fit on train, frozen)": offline(train, x_train, test, x_test, order, cost_weight),
        "online router": online(test, x_test, order, params, default, cost_weight),
        "oracle (cheapest right arm)": fixed(test, order, lambda _s, i: oracle[i]),
    })
    ref = runs[f"best fixed in hindsight: {test.arms[best]}"]
    lines = [f"### {name}: n = {len(test.prompts)} held-out items ({len(train.prompts)} train), {requests} requests "
             f"a seed, {seeds} seeds; cost_weight {cost_weight:g}", "",
             f"Default arm (best on train): {test.arms[default]}. Policy chosen on train: alpha {params.alpha:g}, "
             f"warmup {params.warmup}, explore {params.explore:g} (half-life {params.explore_half_life:g}, "
             f"floor {params.explore_floor:g}), dims {dims}.", "",
             f"| system | accuracy, first {after} [95% CI] | accuracy after {after} [95% CI] | vs best fixed after "
             f"{after} [95% CI] | cost / 1k requests after {after} | explored |",
             "|---|---|---|---|---|---|"]
    curves: dict[str, list[float]] = {}
    cum_oracle = np.cumsum(runs["oracle (cheapest right arm)"].right - cost_weight
                           * runs["oracle (cheapest right arm)"].cost, axis=1)
    for label, run in runs.items():
        a1 = interval(run.right[:, :after].mean(1))
        a2 = interval(run.right[:, after:].mean(1))
        d = interval(run.right[:, after:].mean(1) - ref.right[:, after:].mean(1))
        c = 1000 * float(run.cost[:, after:].mean())
        ex = f"{100 * float(run.explored.mean()):.1f}%" if run.explored is not None else ""
        lines.append(f"| {label} | {100 * a1[0]:.1f} [{100 * a1[1]:.1f}, {100 * a1[2]:.1f}] | {100 * a2[0]:.1f} "
                     f"[{100 * a2[1]:.1f}, {100 * a2[2]:.1f}] | {100 * d[0]:+.1f} [{100 * d[1]:+.1f}, {100 * d[2]:+.1f}]"
                     f" | {c:.3f} | {ex} |")
        regret = cum_oracle - np.cumsum(run.right - cost_weight * run.cost, axis=1)
        curves[label] = [float(v) for v in regret.mean(0)]
    # each held-out item once (a seeded permutation): no item is seen twice, so nothing is recognised
    once = np.stack([np.random.default_rng(s).permutation(len(test.prompts)) for s in range(seeds)])
    first_pass = {"online router": online(test, x_test, once, params, default, cost_weight),
                  "offline router (fit on train, frozen)": offline(train, x_train, test, x_test, once, cost_weight),
                  f"best fixed in hindsight: {test.arms[best]}": fixed(test, once, lambda _s, _i: best),
                  f"default: {test.arms[default]}": fixed(test, once, lambda _s, _i: default)}
    w = params.warmup
    lines += ["", f"Each held-out item once ({len(test.prompts)} requests a seed, {seeds} seeds; after the safe "
              f"start of {w}):", "", "| system | accuracy [95% CI] | cost / 1k requests |", "|---|---|---|"]
    for label, r in first_pass.items():
        a = interval(r.right[:, w:].mean(1))
        lines.append(f"| {label} | {100 * a[0]:.1f} [{100 * a[1]:.1f}, {100 * a[2]:.1f}] | "
                     f"{1000 * float(r.cost[:, w:].mean()):.3f} |")
    # the safe-start goal: after it, never below the default arm by more than the default's interval
    on, de = runs["online router"], runs[f"{test.arms[default]} (fixed)"]
    worst = 1.0
    for s in range(seeds):
        for t in range(params.warmup + 50, requests + 1, 10):
            n = t - params.warmup
            p = de.right[s, params.warmup:t].mean()
            half = 1.96 * np.sqrt(max(p * (1 - p), 1e-9) / n)
            worst = min(worst, float(on.right[s, params.warmup:t].mean() - (p - half)))
    lines += ["", f"- Safe start: over {seeds} seeds and every 10 requests from {params.warmup + 50} on, the online "
              f"router's accuracy since the safe start minus the lower end of the default arm's 95% interval on the "
              f"same requests is at least {100 * worst:+.1f} points ({'never below' if worst >= 0 else 'below'} it).",
              "- Tuning grid on train (mean reward after the first requests):", *[f"  - {g}" for g in grid]]
    return lines, {"name": f"{name}, cost_weight {cost_weight:g}", "after": after, "curves": curves, "default": test.arms[default],
                   "best": test.arms[best]}


def figure(panels: list[dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(2, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, panel in zip(axes.flat, panels):
        curves = panel["curves"]
        assert isinstance(curves, dict)
        for label, ys in curves.items():
            if label.startswith("oracle") or (label.endswith("(fixed)") and not label.startswith(
                    (str(panel["default"]), str(panel["best"])))):
                continue
            ax.plot(range(1, len(ys) + 1), ys, label=label, lw=2.2 if label == "online router" else 1.2)
        ax.axvline(int(str(panel["after"])), color="grey", ls=":", lw=1)
        ax.set_title(str(panel["name"]), fontsize=10)
        ax.set_xlabel("requests")
        ax.set_ylabel("cumulative regret against the oracle (reward)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args: argparse.Namespace) -> int:
    prices = {SMALL: args.price_small, LARGE: args.price_large}
    cache, data = Path(args.gsm8k_cache), Path(args.gsm8k_data)
    out: list[str] = [f"chorus bench online (prices per million tokens: 0.5B {args.price_small:g}, 1.5B "
                      f"{args.price_large:g}; replay of logged outcomes)", ""]
    panels = []
    g_train, g_test = (gsm8k_table(cache, data, split, prices, args.tau, below)
                       for split, below in (("train", None), ("test", args.gsm8k_test_items)))
    envs = [("GSM8K, five arms (accuracy only)", g_train, g_test, 0.0)]
    if args.addition:
        a_train, a_test = addition_tables(Path(args.addition), Path(args.addition_answers), prices)
        mixed_train, mixed_test = g_train.first(2) + a_train, g_test.first(2) + a_test  # the two greedy arms
        for cw in args.cost_weight or [0.0]:
            envs.append(("GSM8K + addition mixed, two arms (cost-aware)", mixed_train, mixed_test, cw))
    for name, train, test, cw in envs:
        lines, panel = report(name, train, test, args.requests, args.seeds, args.after, cw, args.dims)
        out += [*lines, ""]
        panels.append(panel)
    print("\n".join(out))
    if args.figure:
        figure(panels, Path(args.figure))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gsm8k-cache", default="docs/data/gsm8k", help="chorus eval gsm8k's answer cache")
    p.add_argument("--gsm8k-data", default="../shared/data/gsm8k", help="the GSM8K questions (train/test.jsonl)")
    p.add_argument("--gsm8k-test-items", type=int, help="only test items 0 .. N-1 (default: every cached one; the "
                                                        "answer cache grows, this pins a table to the items it had)")
    p.add_argument("--addition", help="the addition problems (chorus eval addition --write)")
    p.add_argument("--addition-answers", help="their greedy answers per model (MODEL.jsonl, bench selector's cache)")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--after", type=int, default=300, help="report accuracy before and after this many requests")
    p.add_argument("--cost-weight", type=float, action="append", default=None,
                   help="the mixed environment's cost weight (reward = right - weight x price); repeatable")
    p.add_argument("--price-small", type=float, default=0.494, help="0.5B: price per million tokens")
    p.add_argument("--price-large", type=float, default=1.54, help="1.5B: price per million tokens")
    p.add_argument("--tau", type=float, default=0.75, help="the cascade arm's agreement threshold")
    p.add_argument("--dims", type=int, default=0, help="the embedding's projection (0: all 384, as served)")
    p.add_argument("--figure", help="write the regret curves (PNG)")
