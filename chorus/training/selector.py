"""Fitting the ``select`` strategy's selector (chorus/ensembles/fitted/selector.py) on labelled multiple-choice items:
every member's cached answers, the gold choice. The learner is scikit-learn's logistic regression on the
stacked (item, choice) rows (is this choice the gold one?); its regularisation is chosen by cross-validation
over items on the training data only.

The cross-validated result decides what is served: the artifact keeps the learner only where its gain over the
best single system (a member under one normalisation, chosen inside each fold's training part) has a paired
bootstrap 95% interval above zero;
otherwise it falls back to the best member of the training data, and says so (``fallback``).
"""

from __future__ import annotations

import hashlib
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from chorus import stats
from chorus.ensembles.fitted.learned_router import LearnedRouter, pack
from chorus.ensembles.fitted.selector import NORMS, Selector, choice_features, feature_names

C_GRID = (0.01, 0.1, 1.0, 10.0)  #: the logistic regression's inverse regularisation, chosen by cross-validation


def correctness(answers: list[Any], gold: np.ndarray, norms: list[str]) -> np.ndarray:
    """(items, members): member k right under its normalisation ``norms[k]``."""
    return np.array([[int(np.argmax(a[k][nm])) == g for k, nm in enumerate(norms)] for a, g in zip(answers, gold)],
                    int)


def best_norms(answers: list[Any], gold: np.ndarray, n_members: int) -> tuple[list[str], int]:
    """Each member's best normalisation on these items (what serving that member alone would use), and the
    index of the best member under it."""
    by_norm = {nm: correctness(answers, gold, [nm] * n_members).mean(axis=0) for nm in NORMS}
    norms = [str(max(NORMS, key=lambda nm: float(by_norm[nm][k]))) for k in range(n_members)]
    return norms, int(np.argmax([by_norm[norms[k]][k] for k in range(n_members)]))


def _design(items: list[list[dict[str, list[float]]]], prompts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Stacked (item, choice) rows and the item index of each row."""
    blocks = [choice_features(a, n) for a, n in zip(items, prompts)]
    groups = np.concatenate([np.full(len(b), i) for i, b in enumerate(blocks)])
    return np.concatenate(blocks), groups


def _fit(x: np.ndarray, y: np.ndarray, c: float) -> tuple[Any, Any]:
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(x)
    scale = np.where(scaler.scale_ > 0, scaler.scale_, 1.0)
    model = LogisticRegression(C=c, max_iter=2000).fit((x - scaler.mean_) / scale, y)
    return (scaler.mean_, scale), model


def _choose(x: np.ndarray, groups: np.ndarray, norm: tuple[Any, Any], model: Any) -> np.ndarray:
    scores = model.decision_function((x - norm[0]) / norm[1])
    return np.array([int(np.argmax(scores[groups == g])) for g in np.unique(groups)])


def fit_selector(members: list[str], items: list[list[dict[str, list[float]]]], gold: np.ndarray,
                 prompts: list[int], *, data_hash: str, folds: int = 5, seed: int = 0) -> Selector:
    """``items[i][m]``: member m's probabilities per normalisation on item i; ``gold[i]``: the right choice."""
    from sklearn.model_selection import KFold


    if len(items) < 2 * folds:
        raise ValueError(f"need at least {2 * folds} labelled items to cross-validate, got {len(items)}")
    x, groups = _design(items, prompts)
    y = np.concatenate([(np.arange(len(a[0][NORMS[0]])) == g).astype(int) for a, g in zip(items, gold)])
    # every single system a user could serve instead: each member under each normalisation (items, members x 3)
    member_right = np.array([[int(np.argmax(a[m][nm])) == g for m in range(len(members)) for nm in NORMS]
                             for a, g in zip(items, gold)], dtype=int)
    kf = KFold(folds, shuffle=True, random_state=seed)
    per_c: dict[float, np.ndarray] = {}
    best_member_right = np.zeros(len(items), dtype=int)
    for c in C_GRID:
        right = np.zeros(len(items), dtype=int)
        for train_i, test_i in kf.split(np.arange(len(items))):
            rows = np.isin(groups, train_i)
            norm, model = _fit(x[rows], y[rows], c)
            test_rows = np.isin(groups, test_i)
            chosen = _choose(x[test_rows], groups[test_rows], norm, model)
            right[test_i] = (chosen == gold[np.unique(groups[test_rows])]).astype(int)
            best = int(member_right[train_i].mean(axis=0).argmax())  # chosen on the fold's training part
            best_member_right[test_i] = member_right[test_i, best]
        per_c[c] = right
    c_best = max(C_GRID, key=lambda c: (per_c[c].mean(), -c))
    diff = stats.paired_difference(per_c[c_best], best_member_right)
    best_overall = int(member_right.mean(axis=0).argmax()) // len(NORMS)
    norm, model = _fit(x, y, c_best)
    fallback = None if diff.low > 0 else members[best_overall]
    oracle = float(member_right.max(axis=1).mean())
    training = {
        "items": len(items), "data_sha256": data_hash, "folds": folds, "seed": seed, "C_grid": list(C_GRID),
        "cv": {"selector_acc": float(per_c[c_best].mean()), "best_member_acc": float(best_member_right.mean()),
               "gain": diff.delta, "gain_ci": [diff.low, diff.high], "mcnemar_p": diff.p_mcnemar,
               "oracle_acc": oracle, "acc_by_C": {str(c): float(r.mean()) for c, r in per_c.items()}},
        "member_acc": {f"{m}:{nm}": float(member_right[:, i * len(NORMS) + j].mean())
                       for i, m in enumerate(members) for j, nm in enumerate(NORMS)},
        "fallback_reason": None if fallback is None else
        f"the cross-validated gain over the best member ({100 * diff.delta:+.1f} points, 95% CI "
        f"[{100 * diff.low:+.1f}, {100 * diff.high:+.1f}]) does not exclude zero",
    }
    return Selector(members, feature_names(members), model.coef_[0].tolist(), float(model.intercept_[0]),
                    norm[0].tolist(), norm[1].tolist(), c_best, fallback, training,
                    {p: version(p) for p in ("chorus-gateway", "scikit-learn", "numpy")})


def data_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


K_GRID = (5, 10, 20, 50)  #: the router's neighbours, chosen by cross-validation


def fit_router(members: list[str], embeddings: np.ndarray, correct: np.ndarray, costs: list[float], *,
               margin: float = 0.0, data_hash: str, folds: int = 5, seed: int = 0) -> LearnedRouter:
    """The prompt-only router: ``embeddings`` (items, dim) unit vectors of the training prompts, ``correct``
    (items, members) whether each member was right, ``costs`` each member's price per item. Its k is chosen by
    cross-validated accuracy at ``margin``. It falls back to the best member where, at that margin, its
    cross-validated accuracy is below the best member's with an interval that excludes zero (a router is
    there to keep accuracy for fewer calls of the best member, so equal accuracy is not a reason to fall back)."""
    from sklearn.model_selection import KFold


    n = len(correct)
    if n < 2 * folds:
        raise ValueError(f"need at least {2 * folds} labelled items to cross-validate, got {n}")
    emb = np.asarray(embeddings, dtype=np.float64)
    right = np.asarray(correct, dtype=int)
    kf = KFold(folds, shuffle=True, random_state=seed)

    def router(idx: np.ndarray, k: int) -> LearnedRouter:
        return LearnedRouter(members, list(costs), k, margin, emb.shape[1], pack(emb[idx]), right[idx].tolist())

    per_k: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    best_right = np.zeros(n, dtype=int)
    for k in K_GRID:
        got, to = np.zeros(n, dtype=int), np.zeros(n, dtype=int)
        for train_i, test_i in kf.split(np.arange(n)):
            r = router(train_i, min(k, len(train_i)))
            best = int(right[train_i].mean(axis=0).argmax())
            for i in test_i:
                c = r.choose(r.predict(emb[i])[0])
                got[i], to[i] = right[i, c], int(c == best)
            best_right[test_i] = right[test_i, best]
        per_k[k] = (got, to)
    k_best = max(K_GRID, key=lambda k: (per_k[k][0].mean(), -k))
    got, to = per_k[k_best]
    diff = stats.paired_difference(got, best_right)
    best_overall = int(right.mean(axis=0).argmax())
    fallback = members[best_overall] if diff.high < 0 else None
    training = {
        "items": n, "data_sha256": data_hash, "folds": folds, "seed": seed, "k_grid": list(K_GRID),
        "cv": {"router_acc": float(got.mean()), "best_member_acc": float(best_right.mean()), "gain": diff.delta,
               "gain_ci": [diff.low, diff.high], "mcnemar_p": diff.p_mcnemar, "share_to_best": float(to.mean()),
               "acc_by_k": {str(k): float(v[0].mean()) for k, v in per_k.items()}},
        "member_acc": {m: float(right[:, i].mean()) for i, m in enumerate(members)},
        "fallback_reason": None if fallback is None else
        f"at margin {margin} the cross-validated accuracy is below the best member's ({100 * diff.delta:+.1f} "
        f"points, 95% CI [{100 * diff.low:+.1f}, {100 * diff.high:+.1f}])",
    }
    out = router(np.arange(n), k_best)
    out.fallback, out.training = fallback, training
    out.versions = {p: version(p) for p in ("chorus-gateway", "scikit-learn", "numpy")}
    return out
