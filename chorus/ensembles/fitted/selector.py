"""A learned selector over a multiple-choice ensemble's members (the ``select`` strategy): the features it reads
from the members' answers and the artifact it is served from. Fitting is chorus/training/selector.py.

Features, per choice of an item (`feature_names`): for each member and normalisation (``sum``, ``mean``,
``char``), the choice's probability, its log, whether it is the member's top choice and its rank; for each
member the item's margin (top-1 minus top-2) and normalised entropy; the share of members whose top choice it
is; the prompt's length. The learner is a logistic regression over (item, choice) rows; an item's choice
probabilities are the softmax of its rows' decision values. The artifact is JSON only (members, feature names,
coefficients and scaler, the training data's hash, the cross-validated figures, library versions): nothing is
unpickled when a server loads it (`artifact.Artifact`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from chorus.ensembles.fitted.artifact import Artifact, Logistic
from chorus.errors import ConfigError

NORMS = ("sum", "mean", "char")
PER_MEMBER_CHOICE = ("p", "logp", "top", "rank")
PER_MEMBER_ITEM = ("margin", "entropy")


def feature_names(members: list[str]) -> list[str]:
    names = []
    for m in members:
        names += [f"{m}:{nm}:{f}" for nm in NORMS for f in PER_MEMBER_CHOICE]
        names += [f"{m}:{nm}:{f}" for nm in NORMS for f in PER_MEMBER_ITEM]
    return [*names, *(f"agreement:{nm}" for nm in NORMS), "prompt_log_chars"]


def choice_features(answers: list[dict[str, list[float]]], prompt_chars: int) -> np.ndarray:
    """(choices, features) for one item: ``answers[m][norm]`` is member m's distribution over the choices."""
    n = len(answers[0][NORMS[0]])
    cols: list[np.ndarray] = []
    tops = {nm: [int(np.argmax(a[nm])) for a in answers] for nm in NORMS}
    for a in answers:
        for nm in NORMS:
            p = np.clip(np.asarray(a[nm], dtype=float), 1e-12, 1.0)
            order = np.argsort(-p, kind="stable")
            rank = np.empty(n)
            rank[order] = np.arange(n) / max(n - 1, 1)
            cols += [p, np.log(p), (np.arange(n) == order[0]).astype(float), rank]
        for nm in NORMS:
            p = np.sort(np.clip(np.asarray(a[nm], dtype=float), 1e-12, 1.0))[::-1]
            margin = p[0] - (p[1] if n > 1 else 0.0)
            entropy = float(-(p * np.log(p)).sum() / math.log(n)) if n > 1 else 0.0
            cols += [np.full(n, margin), np.full(n, entropy)]
    for nm in NORMS:
        cols.append(np.array([sum(t == c for t in tops[nm]) / len(answers) for c in range(n)], dtype=float))
    cols.append(np.full(n, math.log1p(prompt_chars)))
    return np.stack(cols, axis=1)


@dataclass
class Selector(Logistic, Artifact):
    """The artifact: what to compute from the members' answers, and how to choose from it."""

    FILE = "selector.json"
    KIND = "select"

    fallback: str | None = None  #: the member served instead of the learner (its CV gain did not exclude 0)
    training: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    kind: str = "select"
    learner: str = "logistic_regression"
    format: int = 1

    def probabilities(self, answers: list[dict[str, list[float]]], prompt_chars: int) -> dict[str, list[float]]:
        """Per normalisation, the served distribution over the choices: the learner's (the same under every
        normalisation), or the fallback member's own."""
        if self.fallback is not None:
            return dict(answers[self.members.index(self.fallback)])
        logits = self.decision(choice_features(answers, prompt_chars))
        p = np.exp(logits - logits.max())
        probs = (p / p.sum()).tolist()
        return {nm: probs for nm in NORMS}

    def check(self, path: Path) -> None:
        expected = feature_names(self.members)
        if self.features != expected:
            unknown = sorted(set(self.features) - set(expected))
            raise ConfigError(f"{path}: unknown or missing features ({', '.join(unknown[:5]) or 'order differs'}); "
                              "retrain it with this chorus")
        if self.fallback is not None and self.fallback not in self.members:
            raise ConfigError(f"{path}: the fallback {self.fallback!r} is not one of its members")
