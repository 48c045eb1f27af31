"""The online router's learner: a contextual bandit over the prompt's embedding (``router: online``, and the replay
bench, which runs this same code).

Features: the prompt's MiniLM embedding (384 numbers, unit length; with ``dims`` > 0, times a fixed random
projection to ``dims`` numbers, a seeded Gaussian matrix, the same in every replica, for a smaller model and log
entries), and a constant 1. The replay on logged outcomes (`chorus bench online`) chose the whole embedding: the
projection to 32 or 64 lost accuracy on prompts that differ only late (few-shot sums). Model: one ridge regression per arm from features to reward (LinUCB's disjoint model, Li et al.
2010): ``A = ridge * I + sum x x^T``, ``b = sum reward * x``, predicted reward ``theta . x`` with ``theta = A^-1 b``
and an upper-confidence bonus ``alpha * sqrt(x^T A^-1 x)``. With ``discount`` < 1 an arm's old evidence fades each
time it learns (``A <- discount * A + x x^T``), so rewards that drift are followed.

Choosing (`OnlinePolicy.choose`): during the safe start (fewer than ``warmup`` feedbacks learned) the ``default``
arm answers, except with probability ``explore_floor``, when an arm is drawn uniformly; after it, the arm with the
best score answers, except with probability ``epsilon(t) = max(explore_floor, explore * half / (half + t))``
(``t``: feedbacks learned, ``half``: ``explore_half_life``), when one is drawn uniformly. The probability the
chosen arm had (its propensity) is recorded with every decision, so logged decisions can be evaluated offline
without bias (inverse propensity). The floor never lets an arm go unseen for ever: a deployment that drifts is
noticed, at the price of ``explore_floor`` of the traffic on arms the model thinks worse.

Rewards: the feedback's value (a boolean is 1 or 0, a number scaled to 0-1 by its metric's range) minus
``cost_weight`` times the request's cost (thousands of tokens, or the configured prices).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np

EMBEDDING_DIMS = 384  # all-MiniLM-L6-v2


def projection(dims: int, seed: int = 0) -> np.ndarray | None:
    """The fixed random projection of embeddings to ``dims`` numbers (None: ``dims`` 0, the embedding as it is)."""
    if dims <= 0 or dims >= EMBEDDING_DIMS:
        return None
    return np.random.default_rng(seed).standard_normal((EMBEDDING_DIMS, dims)) / np.sqrt(dims)  # (384, d)


def features(embedding: np.ndarray, proj: np.ndarray | None) -> np.ndarray:
    """[1, projected embedding]: (d + 1,)."""
    e = embedding if proj is None else embedding @ proj
    return np.concatenate([[1.0], e])


@dataclass
class LinearArm:
    """One arm's ridge regression, kept as ``A`` and ``b`` and ``A``'s inverse (rank-one updates)."""

    dims: int
    ridge: float = 1.0
    a_inv: np.ndarray = field(init=False)
    b: np.ndarray = field(init=False)
    n: int = 0

    def __post_init__(self) -> None:
        self.a_inv = np.eye(self.dims) / self.ridge  # (d, d)
        self.b = np.zeros(self.dims)  # (d,)

    def score(self, x: np.ndarray, alpha: float) -> tuple[float, float]:
        """(predicted reward, confidence width) at ``x``."""
        ax = self.a_inv @ x
        return float((self.a_inv @ self.b) @ x), alpha * float(np.sqrt(max(x @ ax, 0.0)))

    def learn(self, x: np.ndarray, reward: float, discount: float = 1.0) -> None:
        if discount < 1.0:  # A <- discount * A (+ the ridge's share that fades, so A stays invertible), b likewise
            a = np.linalg.inv(self.a_inv) * discount + np.eye(self.dims) * self.ridge * (1.0 - discount)
            self.a_inv = np.linalg.inv(a)
            self.b = self.b * discount
        ax = self.a_inv @ x  # Sherman-Morrison: (A + x x^T)^-1
        self.a_inv = self.a_inv - np.outer(ax, ax) / (1.0 + x @ ax)
        self.b = self.b + reward * x
        self.n += 1


@dataclass(frozen=True)
class PolicyParams:
    """The defaults are the replay's choice on the training splits (`chorus bench online`, docs/evidence.md)."""

    alpha: float = 0.3  #: the confidence bonus's weight
    ridge: float = 1.0
    discount: float = 1.0  #: 1: every feedback counts for ever; < 1: old ones fade (drifting rewards)
    explore: float = 0.1  #: the exploration rate at the start of learning
    explore_half_life: float = 200.0  #: feedbacks after which it has halved
    explore_floor: float = 0.02  #: it never falls below this
    warmup: int = 30  #: feedbacks before the model chooses (until then the default arm answers)


@dataclass
class Decision:
    arm: int
    propensity: float
    explored: bool
    scores: list[float] | None  # None during the safe start
    phase: str  # "safe start" or "learned"


class OnlinePolicy:
    """Arms by index; ``default`` answers during the safe start."""

    def __init__(self, arms: int, dims: int, params: PolicyParams, default: int = 0) -> None:
        self.params = params
        self.default = default
        self.arms = [LinearArm(dims, params.ridge) for _ in range(arms)]
        self.learned = 0  # feedbacks learned (t)

    def epsilon(self) -> float:
        p = self.params
        if self.learned < p.warmup:
            return p.explore_floor
        t = self.learned - p.warmup
        return max(p.explore_floor, p.explore * p.explore_half_life / (p.explore_half_life + t))

    def scores(self, x: np.ndarray) -> list[tuple[float, float]]:
        return [a.score(x, self.params.alpha) for a in self.arms]

    def choose(self, x: np.ndarray, rng: random.Random) -> Decision:
        k, eps = len(self.arms), self.epsilon()
        warm = self.learned < self.params.warmup
        scored = None if warm else self.scores(x)
        best = self.default if scored is None else max(range(k), key=lambda i: scored[i][0] + scored[i][1])
        explored = rng.random() < eps
        arm = rng.randrange(k) if explored else best
        propensity = eps / k + (1.0 - eps) * (arm == best)
        return Decision(arm, propensity, explored and arm != best,
                        None if scored is None else [round(m + w, 4) for m, w in scored],
                        "safe start" if warm else "learned")

    def learn(self, arm: int, x: np.ndarray, reward: float) -> None:
        self.arms[arm].learn(x, reward, self.params.discount)
        self.learned += 1

    def describe(self) -> dict[str, Any]:
        return {"learned": self.learned, "epsilon": round(self.epsilon(), 4),
                "per_arm": [a.n for a in self.arms]}
