"""A small verifier over an answer-side ensemble's samples: how likely each sample's answer is right, from cheap
features of the samples themselves (no other model). Served by `answer_vote` (``pick: verifier`` or ``weigh:
verifier``); fitted by `chorus train verifier` (chorus/training/verifier.py) on cached train answers.

Features of a sample, among the samples of one request (`feature_names`):

- ``agreement``: the share of the samples with an answer that give its answer (self-consistency's signal);
- ``finished``: 1 when it ended on its own, 0 when cut at ``max_tokens``;
- ``log_tokens``: log(1 + its tokens);
- ``greedy``: 1 for a member's greedy answer (``greedy: true``), 0 for a sample;
- with ``confidence``: each measure of `answers.confidence.MEASURES` (``mean_logprob`` floored at -10), and each minus
  the request's mean of it (``rel_*``: how sure this sample is against the others on the same question);
- with several members: one-hot of the model that drew it (``member:MODEL``).

The learner is a logistic regression over (request, sample) rows (is this sample's answer right?). The artifact
is JSON only (members, features, coefficients and scaler, window and tail of the measures, the training data's
hash and cross-validated figures, library versions): nothing is unpickled when a server loads it
(`artifact.Artifact`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from scipy.special import expit

from chorus.ensembles.answers.confidence import MEASURES, measure
from chorus.ensembles.answers.votes import Sample
from chorus.ensembles.fitted.artifact import Artifact, Logistic
from chorus.errors import ConfigError

BASE = ("agreement", "finished", "log_tokens", "greedy")
FLOOR = -10.0  #: mean_logprob of a sample with no tokens, and the floor of any


def feature_names(members: Sequence[str], confidence: bool) -> list[str]:
    names = list(BASE)
    if confidence:
        names += [*MEASURES, *(f"rel_{m}" for m in MEASURES)]
    if len(members) > 1:
        names += [f"member:{m}" for m in members]
    return names


def sample_features(samples: Sequence[Sample], models: Sequence[str], members: Sequence[str], confidence: bool,
                    window: int, tail: int) -> np.ndarray:
    """(samples, features) of one request's samples; ``models[i]``: the model that drew sample i."""
    answered = [s.canonical for s in samples if s.canonical]
    cols: list[np.ndarray] = [
        np.array([answered.count(s.canonical) / len(answered) if s.canonical and answered else 0.0 for s in samples]),
        np.array([0.0 if s.cut else 1.0 for s in samples]),
        np.array([math.log1p(s.tokens) for s in samples]),
        np.array([1.0 if s.greedy else 0.0 for s in samples])]
    if confidence:
        if any(s.per_token is None for s in samples):
            raise ValueError("the verifier reads confidence: every sample needs its token log-probabilities")
        values = np.array([[max(FLOOR, measure(s.per_token, how, window, tail)) for how in MEASURES]
                           for s in samples if s.per_token is not None])
        cols += [values[:, j] for j in range(len(MEASURES))]
        cols += [values[:, j] - values[:, j].mean() for j in range(len(MEASURES))]
    if len(members) > 1:
        cols += [np.array([1.0 if m == member else 0.0 for m in models]) for member in members]
    return np.stack(cols, axis=1)


@dataclass
class Verifier(Logistic, Artifact):
    """The artifact: what to compute from the samples, and the probability of each being right."""

    FILE = "verifier.json"
    KIND = "verifier"

    confidence: bool
    window: int = 64
    tail: int = 64
    training: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    kind: str = "verifier"
    learner: str = "logistic_regression"
    format: int = 1

    def scores(self, samples: Sequence[Sample], models: Sequence[str]) -> list[float]:
        """Each sample's probability of being right."""
        if not samples:
            return []
        x = sample_features(samples, models, self.members, self.confidence, self.window, self.tail)
        return [float(p) for p in expit(self.decision(x))]

    def check(self, path: Path) -> None:
        expected = feature_names(self.members, self.confidence)
        if self.features != expected or not self.shaped():
            raise ConfigError(f"{path}: its features are not this chorus's ({', '.join(expected)}); retrain it")
