"""`chorus bench answers`' confidence section: one model's samples voted, filtered, weighed and picked by their own
confidence (`ensembles.answers.decide.decide`, the served `answer_vote` decision) and by the verifier of `chorus train
verifier` (`training.verifier.fit_verifier`, the same fit), replayed over the cached samples and their scores.

Every choice on train: the rule (measure, ``keep``, ``weigh``, window) with the best train accuracy, ties to the
simpler rule (no filter, no weights, the earlier measure); the verifier's regularisation by cross-validation on
train. The test split is only reported, on the items whose samples are all scored (n printed): accuracy with its
Wilson interval, the difference from the model's greedy answer and from its plain majority vote at the same
samples (paired bootstrap interval, McNemar's p), tokens and modeled seconds per item; then the ceilings (pass@1,
pass@k of the samples, and with the greedy answer) and every rule of the grid (to show the spread the train
choice was made in, not to choose by).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from chorus import stats as S
from chorus.bench.answers import Item, Outcome, complete, draw, greedy, load, model_seconds, score
from chorus.ensembles.answers.confidence import MEASURES
from chorus.ensembles.answers.decide import Rule, decide
from chorus.ensembles.answers.votes import Sample
from chorus.ensembles.fitted.verifier import Verifier
from chorus.training.cascade import same
from chorus.training.verifier import fit_verifier

KEEPS = (1.0, 0.75, 0.5)
WINDOWS = (16, 32, 64)


def grid() -> list[Rule]:
    """Every rule the train split chooses from, simplest first."""
    rules = [Rule()]
    for by, keep, weigh in itertools.product(MEASURES, KEEPS, ("none", "confidence")):
        if keep == 1.0 and weigh == "none":
            continue  # the measure would be read by nothing
        for w in WINDOWS if by in ("lowest_window", "bottom_10") else (64,):
            rules.append(Rule(by, keep, weigh, "vote", w, w))
    for by in MEASURES:
        for w in WINDOWS if by in ("lowest_window", "bottom_10", "tail") else (64,):
            rules.append(Rule(by, 1.0, "none", "most_confident", w, w))
    return rules


def label(r: Rule) -> str:
    if r.plain:
        return "majority (ties: mean log-probability)"
    win = f", window {r.window}" if r.by in ("lowest_window", "bottom_10", "tail") else ""
    if r.pick == "most_confident":
        return f"most confident sample by {r.by}{win}"
    parts = ([f"keep {r.keep:g}"] if r.keep < 1 else []) + (["weighted"] if r.weigh == "confidence" else [])
    return f"vote by {r.by}{win}: " + ", ".join(parts)


def plain(samples: list[Sample]) -> list[Sample]:
    """The samples without their log-probabilities: ties go to the answer seen first (plain majority)."""
    return [dataclasses.replace(s, mean_logprob=None) for s in samples]


@dataclasses.dataclass(frozen=True)
class Mix:
    """What one pooled row asks for: each model's first k samples, after the greedy answers of ``greedy_of``
    (`answer_vote`'s ``greedy: true``: each greedy answer one more sample, first)."""

    ks: tuple[tuple[str, int], ...]
    greedy_of: tuple[str, ...] = ()

    def gather(self, it: Item) -> tuple[list[Sample], list[str], float, float]:
        samples: list[Sample] = []
        models: list[str] = []
        tokens = seconds = 0.0
        for m in self.greedy_of:
            g = it.greedy[m]
            samples += [dataclasses.replace(x, greedy=True) for x in g.samples]
            models += [m] * len(g.samples)
            tokens += g.tokens
            seconds += g.seconds
        for m, k in self.ks:
            got, t, sec = draw(it, m, k)
            samples += got
            models += [m] * len(got)
            tokens += t
            seconds += sec
        return samples, models, tokens, seconds

    @property
    def models(self) -> list[str]:
        return sorted({*self.greedy_of, *(m for m, k in self.ks if k)})

    def label(self, short: dict[str, str]) -> str:
        parts = [f"{short[m]} greedy" for m in self.greedy_of] + [f"{short[m]} {k} samples" for m, k in self.ks if k]
        return " + ".join(parts)


def take(it: Item, m: str, k: int, with_greedy: bool = False) -> tuple[list[Sample], float, float]:
    """``m``'s first k samples (its greedy answer first, with ``with_greedy``: `answer_vote`'s ``greedy: true``),
    their tokens and seconds."""
    samples, _, tokens, seconds = Mix(((m, k),), (m,) if with_greedy else ()).gather(it)
    return samples, tokens, seconds


def rule_row(m: str, k: int, rule: Rule, verifier: Verifier | None = None, first_seen: bool = False,
             with_greedy: bool = False) -> Callable[[Item], Outcome]:
    def run(it: Item) -> Outcome:
        samples, tokens, seconds = take(it, m, k, with_greedy)
        d = decide(plain(samples) if first_seen else samples, rule, None, "abstain", verifier, [m] * len(samples))
        return Outcome(same(d.answer, it.reference), len(samples), tokens, seconds)
    return run


def scored(items: dict[int, Item], m: str, k: int, with_greedy: bool = False) -> dict[int, Item]:
    """Items whose first k samples of ``m`` (and its greedy answer) all carry their token numbers."""
    return {i: it for i, it in items.items() if len(draw(it, m, k)[0]) >= k and m in it.greedy
            and all(s.per_token is not None for s in take(it, m, k, with_greedy)[0])}


def accuracy(items: dict[int, Item], row: Callable[[Item], Outcome]) -> float:
    return float(np.mean([o.right for o in score(items, row)])) if items else 0.0


def fit_rule(train: dict[int, Item], m: str, k: int, with_greedy: bool = False) -> Rule:
    rules = grid()
    accs = [accuracy(train, rule_row(m, k, r, with_greedy=with_greedy)) for r in rules]
    return rules[max(range(len(rules)), key=lambda i: (accs[i], -i))]


def train_verifier(train: dict[int, Item], m: str, k: int, confidence: bool, with_greedy: bool = False
                   ) -> Verifier:
    groups = [take(it, m, k, with_greedy)[0] for _, it in sorted(train.items())]
    right = [[same(s.canonical, it.reference) for s in g] for g, (_, it) in zip(groups, sorted(train.items()))]
    return fit_verifier(groups, [[m] * len(g) for g in groups], right, [m], confidence=confidence)


def section(train: dict[int, Item], test: dict[int, Item], m: str, k: int, with_greedy: bool = False
            ) -> list[str]:
    """The confidence section's lines for model ``m``'s first k samples (and its greedy answer)."""
    tr, te = scored(train, m, k, with_greedy), scored(test, m, k, with_greedy)
    what = f"its greedy answer + {k} samples (greedy: true)" if with_greedy else f"its first {k} samples"
    if not tr or not te:
        return ["", f"Confidence over {what}: no scored answers of {m} (run `chorus eval gsm8k-score`): skipped."]
    fitted = fit_rule(tr, m, k, with_greedy)
    ver = train_verifier(tr, m, k, True, with_greedy)
    cheap = train_verifier(tr, m, k, False, with_greedy)
    base = np.array([o.right for o in score(te, greedy(m))], dtype=float)
    maj = np.array([o.right for o in score(te, rule_row(m, k, Rule(), first_seen=True, with_greedy=with_greedy))],
                   dtype=float)
    n = k + with_greedy

    def row(rule: Rule, verifier: Verifier | None = None, first_seen: bool = False) -> Callable[[Item], Outcome]:
        return rule_row(m, k, rule, verifier, first_seen, with_greedy)

    rows: list[tuple[str, Callable[[Item], Outcome]]] = [
        (f"{m} greedy", greedy(m)),
        (f"plain majority of {n} (ties: first seen)", row(Rule(), first_seen=True)),
        (f"majority of {n}, ties by mean log-probability (answer_vote's default)", row(Rule())),
        (f"**fitted on train**: {label(fitted)}", row(fitted)),
        ("verifier (agreement, confidence, finished, length; C fitted by CV on train): pick",
         row(Rule(pick="verifier"), ver)),
        ("same verifier: weighted vote", row(Rule(weigh="verifier"), ver)),
        ("verifier without confidence (agreement, finished, length): pick", row(Rule(pick="verifier"), cheap)),
    ]
    if not with_greedy:
        rows.append((f"plain majority of the greedy answer + {k} samples (greedy: true)",
                     pooled_row(Mix(((m, k),), (m,)), Rule())))
    lines = ["", f"Confidence ({m}, {what}): test n={len(te)} items whose answers are all scored "
             f"(choices on train, n={len(tr)}); the rule fitted on train: {label(fitted)}; the verifier's "
             f"cross-validated pick on train {100 * ver.training['cv']['pick_acc']:.1f}% against majority "
             f"{100 * ver.training['cv']['majority_acc']:.1f}% (C = {ver.C:g}).", "",
             "| row | accuracy [95% CI] | vs greedy [95% CI] | McNemar p | vs plain majority [95% CI] | McNemar p | "
             "tokens / item | seconds / item |", "|---|---|---|---:|---|---:|---:|---:|"]
    for name, make in rows:
        out = score(te, make)
        right = np.array([o.right for o in out], dtype=float)
        lo, hi = S.accuracy_interval(right)
        d, dm = S.paired_difference(right, base), S.paired_difference(right, maj)
        lines.append(f"| {name} | {100 * right.mean():.1f} [{100 * lo:.1f}, {100 * hi:.1f}] | {100 * d.delta:+.1f} "
                     f"[{100 * d.low:+.1f}, {100 * d.high:+.1f}] | {d.p_mcnemar:.3g} | {100 * dm.delta:+.1f} "
                     f"[{100 * dm.low:+.1f}, {100 * dm.high:+.1f}] | {dm.p_mcnemar:.3g} | "
                     f"{np.mean([o.tokens for o in out]):.0f} | {np.mean([o.seconds for o in out]):.1f} |")
    ceilings = {
        "pass@1 (a sample's mean accuracy)": np.mean([np.mean([same(s.canonical, it.reference) for s in
                                                                draw(it, m, k)[0]]) for it in te.values()]),
        f"pass@{k}: some sample right": np.mean([any(same(s.canonical, it.reference) for s in draw(it, m, k)[0])
                                                 for it in te.values()]),
        "some sample or the greedy answer right": np.mean([
            any(same(s.canonical, it.reference) for s in draw(it, m, k)[0]) or same(it.greedy[m].answers[0],
                                                                                     it.reference)
            for it in te.values()])}
    lines += ["", "Ceilings on the same items: " + "; ".join(f"{n} {100 * v:.1f}%" for n, v in ceilings.items()) + ".",
              "", "Every rule of the train grid on test (the spread the choice was made in; not chosen by):", "",
              "| rule | train | test |", "|---|---:|---:|"]
    for r in grid():
        lines.append(f"| {label(r)} | {100 * accuracy(tr, row(r)):.1f} | {100 * accuracy(te, row(r)):.1f} |")
    return lines


def pooled_row(mix: Mix, rule: Rule, verifier: Verifier | None = None) -> Callable[[Item], Outcome]:
    """The mix's answers in one decision (plain: ties to the first seen)."""
    def run(it: Item) -> Outcome:
        samples, models, tokens, seconds = mix.gather(it)
        d = decide(plain(samples), rule, None, "abstain", verifier, models)
        return Outcome(same(d.answer, it.reference), len(samples), tokens, seconds, large=len(mix.models) > 1)
    return run


def pooled_verifier(train: dict[int, Item], mix: Mix, members: list[str], confidence: bool) -> Verifier:
    """The verifier over the mix's answers (features as `chorus train verifier`'s), fitted on train."""
    groups, models, right = [], [], []
    for _, it in sorted(train.items()):
        g, ms, _, _ = mix.gather(it)
        groups.append(g)
        models.append(ms)
        right.append([same(s.canonical, it.reference) for s in g])
    return fit_verifier(groups, models, right, members, confidence=confidence)


def all_scored(items: dict[int, Item], mixes: list[Mix]) -> dict[int, Item]:
    """The items whose answers in every mix carry their token numbers."""
    return {i: it for i, it in items.items() if all(s.per_token is not None for x in mixes for s in x.gather(it)[0])}


def pooled(train: dict[int, Item], test: dict[int, Item], small: str, large: str, k_small: int, k_large: int,
           confidence: bool) -> list[str]:
    """Both models' answers together against the larger model alone, at their modeled seconds: plain votes and
    the verifier (with the answers' confidence, or without it: agreement, finished, length, greedy, model).
    Equal cost: each two-model row against the best one-model row that costs no more seconds an item."""
    short = {large: "L", small: "S"}
    one = [Mix(((large, k_large),)), Mix(((large, k_large),), (large,))]
    two = [Mix(((large, 0), (small, k_small)), (large,)), Mix(((large, k_large), (small, k_small))),
           Mix(((large, k_large), (small, k_small)), (large, small))]
    what = "with confidence" if confidence else "without confidence"
    rows: list[tuple[str, bool, Callable[[Item], Outcome]]] = [("L greedy", False, greedy(large))]
    for mix in one + two:
        pair = len(mix.models) > 1
        v = pooled_verifier(train, mix, mix.models, confidence)
        name = mix.label(short)
        rows += [(f"{name}: plain majority", pair, pooled_row(mix, Rule())),
                 (f"{name}: verifier pick ({what})", pair, pooled_row(mix, Rule(pick="verifier"), v)),
                 (f"{name}: verifier-weighted vote", pair, pooled_row(mix, Rule(weigh="verifier"), v))]
    base = np.array([o.right for o in score(test, greedy(large))], dtype=float)
    lines = ["", f"Both models together, verifiers {what} (L = {large}, S = {small}; test n={len(test)}, each "
             f"verifier fitted on train n={len(train)}); equal cost: each two-model row against the best one-model "
             "row that costs no more seconds an item:", "",
             "| row | accuracy [95% CI] | vs L greedy [95% CI] | McNemar p | samples / item | seconds / item | "
             "vs the best one-model row at no more seconds [95% CI] | McNemar p |",
             "|---|---|---|---:|---:|---:|---|---:|"]
    done: list[tuple[np.ndarray, float, str]] = []  # one-model rows: right, seconds, name
    for name, pair, row in rows:
        out = score(test, row)
        right = np.array([o.right for o in out], dtype=float)
        sec = float(np.mean([o.seconds for o in out]))
        lo, hi = S.accuracy_interval(right)
        d = S.paired_difference(right, base)
        line = (f"| {name} | {100 * right.mean():.1f} [{100 * lo:.1f}, {100 * hi:.1f}] | {100 * d.delta:+.1f} "
                f"[{100 * d.low:+.1f}, {100 * d.high:+.1f}] | {d.p_mcnemar:.3g} | "
                f"{np.mean([o.samples for o in out]):.1f} | {sec:.1f} |")
        if not pair:
            done.append((right, sec, name))
            lines.append(line + " | |")
            continue
        peers = [x for x in done if x[1] <= sec]
        r1, _, n1 = max(peers, key=lambda x: x[0].mean())
        e = S.paired_difference(right, r1)
        lines.append(line + f" {100 * e.delta:+.1f} [{100 * e.low:+.1f}, {100 * e.high:+.1f}] vs {n1} | "
                     f"{e.p_mcnemar:.3g} |")
    return lines


def main(args: argparse.Namespace) -> int:
    cache = Path(args.cache)
    m, k = args.model, args.k
    reread, first = not args.stored_answers, args.train_items

    def head(items: dict[int, Any]) -> dict[int, Any]:  # the first --train-items items of train (all: None)
        return {i: it for i, it in items.items() if first is None or i < first}

    train = head(complete(load(cache, "train", [m], reread=reread), {m: k}))
    test = complete(load(cache, "test", [m], reread=reread), {m: k})
    if not train or not test:
        raise SystemExit(f"chorus bench confidence: need cached train and test items of {m} with greedy + {k} "
                         f"samples in {cache}")
    notes = model_seconds({i: it for i, it in test.items() if i < args.quiet_items}, [train, test], [m])
    print(f"chorus bench confidence: GSM8K, {m}, answers made whole at 768 tokens; seconds modeled from tokens:")
    print("\n".join(f"- {n}" for n in notes))
    print("\n".join(section(train, test, m, k)))
    print("\n".join(section(train, test, m, k, with_greedy=True)))
    if args.small:
        need = {m: k, args.small: args.k_small}
        tr2 = head(complete(load(cache, "train", [m, args.small], reread=reread), need))
        te2 = complete(load(cache, "test", [m, args.small], reread=reread), need)
        if not tr2 or not te2:
            print(f"\nBoth models: no items with {need} samples cached: section skipped.")
            return 0
        model_seconds({i: it for i, it in te2.items() if i < args.quiet_items}, [tr2, te2], [m, args.small])
        print("\n".join(pooled(tr2, te2, args.small, m, args.k_small, k, confidence=False)))
        # with confidence: the smaller model's first --k-small-confidence samples, on the items whose every answer
        # is scored (`chorus eval gsm8k-score --samples N` scores only those)
        ks = args.k_small_confidence
        widest = [Mix(((m, k), (args.small, ks)), (m, args.small))]
        tr3, te3 = all_scored(tr2, widest), all_scored(te2, widest)
        if len(tr3) == len(tr2) and te3:
            print("\n".join(pooled(tr3, te3, args.small, m, ks, k, confidence=True)))
        else:
            print(f"\nBoth models with confidence: {len(tr3)} of {len(tr2)} train and {len(te3)} of {len(te2)} test "
                  "items have every answer scored (`chorus eval gsm8k-score`): section skipped.")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache", default="docs/data/gsm8k", help="the answer cache (continued and scored answers "
                                                             "beside it)")
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct-llama")
    p.add_argument("--k", type=int, default=4, help="samples per item")
    p.add_argument("--train-items", type=int, default=None, help="fit on the first N train items only (the "
                   "tables of docs/evidence.md so far: 20, before the train split grew)")
    p.add_argument("--stored-answers", action="store_true", help="the answers as extracted when drawn, not read "
                   "again from their texts by today's extractor (the tables of docs/evidence.md so far)")
    p.add_argument("--small", default="qwen2.5-coder-0.5b-instruct-llama",
                   help="a second model whose samples join (empty: none)")
    p.add_argument("--k-small", type=int, default=8, help="its samples per item")
    p.add_argument("--k-small-confidence", type=int, default=4,
                   help="its samples per item where the verifiers read confidence (those scored)")
    p.add_argument("--quiet-items", type=int, default=30,
                   help="test items drawn on an otherwise idle machine (0 .. N-1): what the seconds are fitted on")
