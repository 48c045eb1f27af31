"""A learned router (the ``route`` strategy's ``router: learned``): before any member answers, predict from the
prompt alone how likely each member is to be right, then send the prompt to the cheapest member whose
predicted accuracy is within ``margin`` of the best prediction (the knob: 0 = the predicted best; larger =
cheaper). Fitting is chorus/training/selector.py (``fit_router``).

The prediction is a k-nearest-neighbour vote over the labelled training prompts (all-MiniLM-L6-v2 embeddings,
cosine): each member's correctness on the k most similar prompts, weighted by similarity, shrunk toward its
overall accuracy (one pseudo-item). Costs are the members' seconds per item on the training data, so
"cheapest" is what was measured. The artifact is JSON (`artifact.Artifact`; the embeddings as base64 float32).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from chorus.ensembles.fitted.artifact import Artifact
from chorus.errors import ConfigError


def pack(x: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(x, dtype="<f4").tobytes()).decode()


def unpack(s: str, dim: int) -> np.ndarray:
    return np.frombuffer(base64.b64decode(s), dtype="<f4").reshape(-1, dim).astype(np.float64)


@dataclass
class LearnedRouter(Artifact):
    """The artifact: the labelled training prompts' embeddings, each member's correctness on them and its cost."""

    FILE = "router.json"
    KIND = "route"

    members: list[str]
    costs: list[float]  #: seconds per item on the training data, one per member
    k: int
    margin: float
    dim: int
    embeddings: str  #: (items, dim) unit vectors, base64 float32
    correct: list[list[int]]  #: (items, members): was the member right on the training item
    fallback: str | None = None  #: served instead of routing (the cross-validation said so)
    training: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    kind: str = "route"
    format: int = 1

    def __post_init__(self) -> None:
        self._emb = unpack(self.embeddings, self.dim)
        self._right = np.asarray(self.correct, dtype=float)
        self._prior = self._right.mean(axis=0)

    def predict(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each member's predicted accuracy on the prompt embedded as ``q``; the neighbours and similarities."""
        sims = self._emb @ q
        nearest = np.argsort(-sims, kind="stable")[: self.k]
        w = np.clip(sims[nearest], 0.0, None) + 1e-6
        pred = (w @ self._right[nearest] + self._prior) / (w.sum() + 1.0)
        return pred, nearest, sims[nearest]

    def choose(self, pred: np.ndarray, margin: float | None = None) -> int:
        """The cheapest member whose prediction is within ``margin`` of the best one."""
        if self.fallback is not None:
            return self.members.index(self.fallback)
        m = self.margin if margin is None else margin
        ok = [i for i in range(len(self.members)) if pred[i] >= pred.max() - m]
        return min(ok, key=lambda i: (self.costs[i], -pred[i]))

    def check(self, path: Path) -> None:
        if len(self.costs) != len(self.members) or self._right.shape[1:] != (len(self.members),):
            raise ConfigError(f"{path}: costs and correctness must have one column per member")
