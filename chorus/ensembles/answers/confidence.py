"""A sample's confidence from its own token log-probabilities: the summaries answer-side strategies weigh, filter
and select samples by (served `answer_vote` and the offline replay call these same functions).

Per token, two numbers: the sampled token's log-probability (``lp``) and DeepConf's *token confidence* (Fu et al.
2025), minus the mean log-probability of the top k tokens at that step (``conf``: high when the distribution is
peaked, low when the model hesitates between many tokens). Both are read before temperature (the model's own
distribution). Per sample, one number by a measure (`MEASURES`):

- ``mean_logprob``: the mean of ``lp`` (the answer's per-token likelihood);
- ``mean_confidence``: the mean of ``conf`` over the whole answer (DeepConf's average trace confidence);
- ``lowest_window``: the lowest mean of ``conf`` over any ``window`` consecutive tokens (DeepConf's lowest group
  confidence: one confused stretch sinks an answer that the average would hide);
- ``bottom_10``: the mean of the lowest 10% of those window means (DeepConf's bottom-10% group confidence);
- ``tail``: the mean of ``conf`` over the last ``tail`` tokens (where the answer is stated).

A sample with fewer tokens than the window has one window, itself.

DeepConf's *online* mode stops a trace while it is drawn: once the mean ``conf`` of its last ``window`` tokens falls
below a threshold, the rest is not generated and the trace does not vote (`Watch` as tokens arrive, `stop_at` over
a whole trace: the same rule, served and replayed).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

Measure = Literal["mean_logprob", "mean_confidence", "lowest_window", "bottom_10", "tail"]
MEASURES: tuple[str, ...] = ("mean_logprob", "mean_confidence", "lowest_window", "bottom_10", "tail")


def token_confidence(top: Sequence[float]) -> float:
    """Minus the mean of one step's top-k log-probabilities (0 when none were returned)."""
    return -float(sum(top)) / len(top) if top else 0.0


@dataclass(frozen=True)
class Tokens:
    """One sample's per-token numbers (the answer's tokens, in order)."""

    lp: Sequence[float]
    conf: Sequence[float]


def windows(conf: Sequence[float], window: int) -> np.ndarray:
    """The mean of every run of ``window`` consecutive token confidences (one, the whole, when shorter)."""
    c = np.asarray(conf, dtype=float)
    if len(c) <= window:
        return np.array([c.mean()]) if len(c) else np.array([0.0])
    sums = np.convolve(c, np.ones(window), mode="valid")
    return np.asarray(sums / window)


def measure(tokens: Tokens, how: str, window: int = 64, tail: int = 64) -> float:
    """One sample's confidence by ``how`` (`MEASURES`); higher is more confident."""
    if how == "mean_logprob":
        return float(np.mean(tokens.lp)) if len(tokens.lp) else -math.inf
    conf = tokens.conf
    if not len(conf):
        return 0.0
    if how == "mean_confidence":
        return float(np.mean(conf))
    if how == "lowest_window":
        return float(windows(conf, window).min())
    if how == "bottom_10":
        w = np.sort(windows(conf, window))
        return float(w[: max(1, math.ceil(0.1 * len(w)))].mean())
    if how == "tail":
        return float(np.mean(conf[-tail:]))
    raise ValueError(f"unknown confidence measure {how!r}: one of {', '.join(MEASURES)}")


class Watch:
    """DeepConf's online stop for one trace as its tokens arrive: `add` each token's confidence; True once the mean
    of the last ``window`` of them is below ``threshold`` (never before ``window`` tokens)."""

    def __init__(self, window: int, threshold: float) -> None:
        self.window, self.threshold = window, threshold
        self.last: deque[float] = deque()
        self.total = 0.0
        self.seen = 0

    def add(self, conf: float) -> bool:
        self.seen += 1
        self.last.append(conf)
        self.total += conf
        if len(self.last) > self.window:
            self.total -= self.last.popleft()
        return len(self.last) == self.window and self.total / self.window < self.threshold


def stop_at(conf: Sequence[float], window: int, threshold: float) -> int | None:
    """The tokens a trace had when `Watch` would have stopped it (None: it never would): the replay of the online
    stop over a trace drawn whole."""
    watch = Watch(window, threshold)
    for i, c in enumerate(conf):
        if watch.add(float(c)):
            return i + 1
    return None


def kept(scores: Sequence[float], keep: float) -> list[bool]:
    """DeepConf's filter: the ``ceil(keep * n)`` highest scores kept (at least one; ties to the earlier)."""
    n = len(scores)
    top = max(1, math.ceil(keep * n - 1e-9))
    order = sorted(range(n), key=lambda i: (-scores[i], i))[:top]
    chosen = set(order)
    return [i in chosen for i in range(n)]


def as_weight(value: float, how: str) -> float:
    """A positive vote weight from a measure's value: the geometric-mean token probability for ``mean_logprob``,
    the confidence itself otherwise (DeepConf's confidence-weighted vote)."""
    if how == "mean_logprob":
        return math.exp(value) if value > -math.inf else 0.0
    return max(value, 0.0)
