"""`chorus train verifier`: the small verifier `answer_vote` serves (chorus/ensembles/fitted/verifier.py), fitted on
cached train answers (the GSM8K cache of `chorus eval gsm8k`, made whole by `chorus eval gsm8k-continue`, scored
by `chorus eval gsm8k-score`), and the readers of that cache `chorus bench answers` shares.

The learner is scikit-learn's logistic regression over (item, sample) rows (is this sample's answer right?),
features standardised; its regularisation is chosen by cross-validation over items on the training data only,
by the accuracy of picking each held-out item's highest-rated sample. The artifact records that accuracy beside
the plain majority vote's on the same folds, so what it gains (or loses) is known before it is served.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from chorus import stats
from chorus.clients.eval_gsm8k import cache_path, read
from chorus.clients.eval_gsm8k_continue import continued_path, key, scored_path, whole
from chorus.ensembles.answers.confidence import Tokens
from chorus.ensembles.answers.votes import Sample, mean_logprob, tally
from chorus.ensembles.fitted.verifier import Verifier, feature_names, sample_features
from chorus.training.cascade import same

C_GRID = (0.01, 0.1, 1.0, 10.0)  #: the logistic regression's inverse regularisation, chosen by cross-validation


@dataclass
class CachedItem:
    """One question's cached answers: per model its greedy answer and its samples (seed order), as `Sample`s."""

    reference: str
    greedy: dict[str, Sample] = field(default_factory=dict)
    samples: dict[str, list[Sample]] = field(default_factory=dict)


def read_scores(root: Path, split: str, model: str, budget: int = 768, k: int = 20) -> dict[tuple[Any, ...], Tokens]:
    """The scored answers' token numbers by (item, kind, seed, choice)."""
    return {key(r, r["choice"]): Tokens(r["lp"], r["conf"]) for r in read(scored_path(root, split, model))
            if r["budget"] == budget and r["k"] == k}


def row_samples(row: dict[str, Any], model: str, scores: dict[tuple[Any, ...], Tokens]) -> list[Sample]:
    """A cache row's choices as samples (member: the model), with their token numbers where scored."""
    out = []
    for i, ch in enumerate(row["choices"]):
        t = scores.get(key(row, i))
        answer = ch["answer"] or ""
        out.append(Sample(model, ch.get("text", ""), answer, answer, mean_logprob(list(t.lp)) if t else None,
                          round(ch["tokens"]), ch.get("finish_reason", "stop"), per_token=t))
    return out


def cached_items(root: Path, split: str, models: Sequence[str], budget: int = 768, k: int = 20
                 ) -> dict[int, CachedItem]:
    """Every cached item of ``split`` with each model's answers made whole at ``budget``."""
    items: dict[int, CachedItem] = {}
    for m in models:
        rows = whole(read(cache_path(root, split, m)), read(continued_path(root, split, m)), budget)
        scores = read_scores(root, split, m, budget, k)
        for r in sorted(rows, key=lambda r: (r["item"], r["seed"] or -1)):
            it = items.setdefault(r["item"], CachedItem(r["reference"]))
            got = row_samples(r, m, scores)
            if r["kind"] == "greedy":
                it.greedy[m] = dataclasses.replace(got[0], greedy=True)
            else:
                it.samples.setdefault(m, []).extend(got)
    return items


def _fit(x: np.ndarray, y: np.ndarray, c: float) -> tuple[np.ndarray, np.ndarray, Any]:
    from sklearn.linear_model import LogisticRegression

    mean = x.mean(axis=0)
    scale = np.where(x.std(axis=0) > 0, x.std(axis=0), 1.0)
    if len(set(y.tolist())) < 2:  # every row right (or wrong): a constant model
        model = None
    else:
        model = LogisticRegression(C=c, max_iter=2000).fit((x - mean) / scale, y)
    return mean, scale, model


def fit_verifier(groups: list[list[Sample]], models: list[list[str]], right: list[list[bool]], members: list[str],
                 *, confidence: bool, window: int = 64, tail: int = 64, data_hash: str = "", folds: int = 5,
                 seed: int = 0) -> Verifier:
    """``groups[i]``: item i's samples (``models[i][j]`` drew sample j; ``right[i][j]``: its answer is right)."""
    from sklearn.model_selection import KFold

    if len(groups) < folds:
        raise ValueError(f"need at least {folds} items to cross-validate, got {len(groups)}")
    blocks = [sample_features(g, m, members, confidence, window, tail) for g, m in zip(groups, models)]
    ys = [np.array(r, dtype=int) for r in right]
    winners = [tally(g).winner for g in groups]
    majority = np.array([bool(w) and any(s.canonical == w and r for s, r in zip(g, rs))
                         for w, g, rs in zip(winners, groups, right)], dtype=int)
    kf = KFold(folds, shuffle=True, random_state=seed)
    per_c: dict[float, np.ndarray] = {}
    for c in C_GRID:
        got = np.zeros(len(groups), dtype=int)
        for tr, te in kf.split(np.arange(len(groups))):
            mean, scale, model = _fit(np.concatenate([blocks[i] for i in tr]), np.concatenate([ys[i] for i in tr]), c)
            for i in te:
                z = (blocks[i] - mean) / scale
                s = model.decision_function(z) if model is not None else np.zeros(len(z))
                got[i] = ys[i][int(np.argmax(s))]
        per_c[c] = got
    c_best = max(C_GRID, key=lambda c: (per_c[c].mean(), -c))
    diff = stats.paired_difference(per_c[c_best], majority)
    x, y = np.concatenate(blocks), np.concatenate(ys)
    mean, scale, model = _fit(x, y, c_best)
    coef = model.coef_[0].tolist() if model is not None else [0.0] * x.shape[1]
    intercept = float(model.intercept_[0]) if model is not None else 0.0
    training = {
        "items": len(groups), "samples": len(y), "right_share": float(y.mean()), "data_sha256": data_hash,
        "folds": folds, "seed": seed, "C_grid": list(C_GRID),
        "cv": {"pick_acc": float(per_c[c_best].mean()), "majority_acc": float(majority.mean()),
               "gain": diff.delta, "gain_ci": [diff.low, diff.high], "mcnemar_p": diff.p_mcnemar,
               "acc_by_C": {str(c): float(r.mean()) for c, r in per_c.items()}},
    }
    return Verifier(list(members), feature_names(members, confidence), coef, intercept, mean.tolist(),
                    scale.tolist(), c_best, confidence, window, tail, training,
                    {p: version(p) for p in ("chorus-gateway", "scikit-learn", "numpy")})


def request_samples(it: CachedItem, models: Sequence[str], k: int, greedy: bool) -> list[Sample]:
    """What one served request of these members would have drawn: each model's first ``k`` samples (and its
    greedy answer first, with ``greedy``)."""
    out: list[Sample] = []
    for m in models:
        out += ([it.greedy[m]] if greedy and m in it.greedy else []) + it.samples.get(m, [])[:k]
    return out


def main(args: argparse.Namespace) -> int:
    from chorus.ensembles.fitted.artifact import artifact_out

    root = Path(args.cache)
    items = cached_items(root, args.split, args.model, args.budget, args.k)
    groups, models, right = [], [], []
    for _, it in sorted(items.items()):
        g = request_samples(it, args.model, args.samples, greedy=args.greedy)
        if len(g) < len(args.model) * (args.samples + args.greedy) or (args.confidence and any(s.per_token is None for s in g)):
            continue  # not every sample drawn (or scored) yet
        groups.append(g)
        models.append([s.member for s in g])
        right.append([same(s.canonical, it.reference) for s in g])
    if not groups:
        print(f"chorus train verifier: no {args.split} item of {', '.join(args.model)} with {args.samples} samples"
              + (" scored" if args.confidence else "") + f" under {root}", file=sys.stderr)
        return 2
    h = hashlib.sha256()
    for m in args.model:
        for path in (cache_path(root, args.split, m), continued_path(root, args.split, m),
                     scored_path(root, args.split, m)):
            h.update(path.read_bytes() if path.is_file() else b"")
    v = fit_verifier(groups, models, right, list(args.model), confidence=args.confidence, window=args.window,
                     tail=args.tail, data_hash=h.hexdigest())
    path = v.save(artifact_out(args.out))
    cv = v.training["cv"]
    print(f"chorus train verifier: {len(groups)} items, {v.training['samples']} samples; cross-validated pick "
          f"{100 * cv['pick_acc']:.1f}% against majority {100 * cv['majority_acc']:.1f}% ({100 * cv['gain']:+.1f}, "
          f"95% CI [{100 * cv['gain_ci'][0]:+.1f}, {100 * cv['gain_ci'][1]:+.1f}]); C = {v.C:g}; wrote {path}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache", default="docs/data/gsm8k", help="the GSM8K answer cache (with its continued and "
                                                             "scored answers)")
    p.add_argument("--model", action="append", required=True, help="a member's model (repeat, in the ensemble's "
                                                                   "order)")
    p.add_argument("--split", default="train", choices=["train", "test"])
    p.add_argument("--samples", type=int, default=4, help="samples per member in a request")
    p.add_argument("--greedy", action="store_true", help="each member's greedy answer is one more sample (for an "
                                                         "answer_vote with greedy: true)")
    p.add_argument("--confidence", action=argparse.BooleanOptionalAction, default=True,
                   help="read the samples' confidence (needs `chorus eval gsm8k-score`)")
    p.add_argument("--window", type=int, default=64, help="tokens per window of the lowest_window measure")
    p.add_argument("--tail", type=int, default=64, help="the tail measure's last tokens")
    p.add_argument("--budget", type=int, default=768, help="the continuation budget answers are made whole at")
    p.add_argument("--k", type=int, default=20, help="the scores' top-k")
    p.add_argument("--out", default="gsm8k-verifier", help="a name in $CHORUS_HOME/selectors, or a folder path")
