"""Statistics for evaluations: intervals, paired comparisons, and combining cached multiple-choice scores.

Every function takes per-item arrays over the same items, so systems are compared pairwise:

* `accuracy_interval`: Wilson 95% interval of an accuracy (scipy's ``binomtest``);
* `paired_difference`: a system's accuracy minus another's on the same items, with a paired bootstrap
  95% interval (scipy's ``bootstrap``, percentile, fixed seed) and McNemar's exact p-value (a two-sided
  binomial test on the items where exactly one of the two is right);
* `combine`: an ensemble's distribution over the choices from its members' cached ones (linear or
  logarithmic pooling, or per item the most confident member), and `fit_weights`, which picks the
  pooling weights that maximise the log-likelihood of the gold choices on other items.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
from scipy import stats

POOLS = ("linear", "log", "confident", "tokens", "calibrated")
TEMPERATURES = np.exp(np.linspace(np.log(0.02), np.log(200.0), 81))


def accuracy_interval(correct: np.ndarray) -> tuple[float, float]:
    k, n = int(correct.sum()), len(correct)
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    return float(ci.low), float(ci.high)


@dataclass
class Difference:
    delta: float
    low: float
    high: float
    p_mcnemar: float
    wins: int  #: items only the system gets right
    losses: int  #: items only the reference gets right


def paired_difference(system: np.ndarray, reference: np.ndarray, resamples: int = 10_000,
                      seed: int = 0) -> Difference:
    a, b = system.astype(float), reference.astype(float)
    wins, losses = int(((a == 1) & (b == 0)).sum()), int(((a == 0) & (b == 1)).sum())
    delta = float(a.mean() - b.mean())
    if wins + losses == 0:
        return Difference(delta, 0.0, 0.0, 1.0, 0, 0)
    res = stats.bootstrap((a, b), lambda x, y, axis=-1: x.mean(axis=axis) - y.mean(axis=axis), paired=True,
                          vectorized=True, n_resamples=resamples, method="percentile",
                          rng=np.random.default_rng(seed))
    p = stats.binomtest(wins, wins + losses, 0.5).pvalue
    return Difference(delta, float(res.confidence_interval.low), float(res.confidence_interval.high), float(p),
                      wins, losses)


def combine(probs: list[np.ndarray], weights: np.ndarray, pool: str) -> np.ndarray:
    """Per item, the ensemble's distribution over the choices: ``probs`` holds one (items, choices) array per
    member (rows sum to 1; items with fewer choices padded with 0)."""
    w = weights / weights.sum()
    stack = np.stack(probs)  # (M, items, choices)
    if pool == "linear":
        return np.tensordot(w, stack, axes=1)
    if pool == "log":
        with np.errstate(divide="ignore"):
            logs = np.tensordot(w, np.log(np.clip(stack, 1e-300, None)), axes=1)
        logs = np.where(stack[0] > 0, logs, -np.inf)
        logs -= logs.max(axis=1, keepdims=True)
        e = np.exp(logs)
        return e / e.sum(axis=1, keepdims=True)
    if pool == "confident":  # each item answered by the member whose best choice is most probable
        pick = (stack.max(axis=2) * w[:, None]).argmax(axis=0)  # (items,)
        return stack[pick, np.arange(stack.shape[1])]
    raise ValueError(f"unknown pool {pool!r}; valid: {', '.join(POOLS)}")


def sharpen(p: np.ndarray, temperature: float) -> np.ndarray:
    """``p ** (1 / T)`` renormalised per item (T < 1 sharpens, T > 1 flattens); zero-padded choices stay 0."""
    with np.errstate(divide="ignore"):
        logs = np.where(p > 0, np.log(np.clip(p, 1e-300, None)) / temperature, -np.inf)
    logs -= logs.max(axis=1, keepdims=True)
    e = np.exp(logs)
    return e / e.sum(axis=1, keepdims=True)


def fit_temperature(p: np.ndarray, gold: np.ndarray) -> float:
    """The temperature (log grid, 0.02 to 200) that maximises the gold choices' mean log-probability: one
    member's calibration, so that members that are right equally often weigh equally in an average."""
    rows = np.arange(len(gold))
    scores = [float(np.log(np.clip(sharpen(p, t)[rows, gold], 1e-12, None)).mean()) for t in TEMPERATURES]
    return float(TEMPERATURES[int(np.argmax(scores))])


def fit_weights(probs: list[np.ndarray], gold: np.ndarray, pool: str, step: float = 0.05) -> np.ndarray:
    """The weights on a grid over the simplex (``step``) that maximise the mean log-probability of the gold
    choices (ties: the first, i.e. the most even grid point is not preferred; the objective rarely ties)."""
    m = len(probs)
    ticks = round(1 / step)
    best, best_w = -np.inf, np.full(m, 1.0 / m)
    for head in itertools.product(range(ticks + 1), repeat=m - 1):
        if sum(head) > ticks:
            continue
        w = np.array([*head, ticks - sum(head)], dtype=float) / ticks
        p = combine(probs, w, pool)[np.arange(len(gold)), gold]
        score = float(np.log(np.clip(p, 1e-12, None)).mean())
        if score > best:
            best, best_w = score, w
    return best_w


def token_mixture(member_token_logprobs: list[list[float]], weights: np.ndarray) -> float:
    """A choice's summed logprob under a per-token probability mixture of members that share one
    tokenization: ``sum_t log sum_i w_i exp(lp_i,t)``."""
    w = weights / weights.sum()
    lps = np.array(member_token_logprobs, dtype=float)  # (M, T)
    keep = w > 0
    return float(np.logaddexp.reduce(lps[keep] + np.log(w[keep])[:, None], axis=0).sum())


def normalised_probabilities(logprobs: np.ndarray, tokens: np.ndarray, chars: np.ndarray, norm: str) -> np.ndarray:
    """One item's softmax over its choices for ``sum``, ``mean`` or ``char`` (as the server computes it)."""
    score = {"sum": logprobs, "mean": logprobs / np.maximum(tokens, 1), "char": logprobs / np.maximum(chars, 1)}[norm]
    e = np.exp(score - score.max())
    return e / e.sum()
