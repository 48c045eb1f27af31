"""Voting and selection that read the samples' own confidence: the one decision served `answer_vote` makes and
`chorus bench answers` replays over cached samples.

A `Rule` names a confidence measure (``by``, `confidence.MEASURES`) and what to do with it:

- ``keep``: DeepConf's filter (Fu et al. 2025): only the ``ceil(keep * n)`` most confident samples vote;
- ``weigh``: each voting sample counts its confidence (``confidence``: `confidence.as_weight`) or a verifier's
  probability that it is right (``verifier``), times its member's weight;
- ``pick``: the reply's answer is the vote's winner (``vote``), or the single most confident sample's answer
  (``most_confident``, self-certainty selection: Kang et al. 2025), or the sample the verifier rates highest
  (``verifier``). A pick prefers a finished sample to one cut at ``max_tokens`` under ``unfinished: abstain``.

Ties of the vote go as `votes.tally` breaks them (mean log-probability, then first seen).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from chorus.ensembles.answers.confidence import as_weight, kept, measure
from chorus.ensembles.answers.votes import Sample, Tally, Unfinished, ranked_samples, tally


class Verifier(Protocol):
    """What the rule reads of a verifier (fitted.verifier.Verifier): each sample's probability of being right."""

    def scores(self, samples: Sequence[Sample], models: Sequence[str]) -> list[float]: ...


PICKS: tuple[str, ...] = ("vote", "most_confident", "verifier")
WEIGHS: tuple[str, ...] = ("none", "confidence", "verifier")


@dataclass(frozen=True)
class Rule:
    by: str = "none"  # a confidence measure, or none
    keep: float = 1.0
    weigh: str = "none"
    pick: str = "vote"
    window: int = 64
    tail: int = 64

    @property
    def plain(self) -> bool:
        """Plain voting: nothing of this module is needed."""
        return self.by == "none" and self.weigh == "none" and self.pick == "vote"


@dataclass
class Decision:
    tally: Tally  # of the samples that voted, as weighted
    answer: str  # the reply's answer ("" when no sample gave one)
    ranked: list[Sample]  # every sample, the reply's first
    confidence: list[float] | None  # per sample, by the rule's measure
    voted: list[bool]  # per sample: kept by the filter
    verified: list[float] | None  # per sample, the verifier's probability


def sample_confidence(s: Sample, by: str, window: int = 64, tail: int = 64) -> float | None:
    """One sample's confidence by ``by`` (`confidence.MEASURES`) from its token numbers; without them, its mean
    log-probability for ``mean_logprob`` (the same number, kept on every sample) and None for the others. What
    `answer_vote`'s gate reads of a greedy answer, served and replayed (`chorus bench gate`)."""
    if s.per_token is not None:
        return measure(s.per_token, by, window, tail)
    return s.mean_logprob if by == "mean_logprob" else None


def decide(samples: Sequence[Sample], rule: Rule, weights: dict[str, float] | None = None,
           unfinished: Unfinished = "abstain", verifier: Verifier | None = None,
           models: Sequence[str] | None = None) -> Decision:
    """The rule applied to one request's samples (``models[i]``: the model of sample i, for the verifier)."""
    conf = ([measure(s.per_token, rule.by, rule.window, rule.tail) if s.per_token is not None else float("-inf")
             for s in samples] if rule.by != "none" else None)
    voted = kept(conf, rule.keep) if conf is not None and rule.keep < 1 else [True] * len(samples)
    verified = (verifier.scores(samples, models or [s.member for s in samples])
                if verifier is not None and (rule.weigh == "verifier" or rule.pick == "verifier") else None)
    voters = []
    for i, s in enumerate(samples):
        if not voted[i]:
            continue
        w = (as_weight(conf[i], rule.by) if rule.weigh == "confidence" and conf is not None
             else verified[i] if rule.weigh == "verifier" and verified is not None else 1.0)
        voters.append(dataclasses.replace(s, weight=w))
    t = tally(voters, weights, unfinished)
    t.drawn = len(samples)
    key = conf if rule.pick == "most_confident" else verified if rule.pick == "verifier" else None
    if key is None:
        return Decision(t, t.winner, ranked_samples(samples, t), conf, voted, verified)
    able = [i for i, s in enumerate(samples) if voted[i] and s.canonical]
    if unfinished == "abstain" and any(not samples[i].cut for i in able):
        able = [i for i in able if not samples[i].cut]
    if not able:
        return Decision(t, t.winner, ranked_samples(samples, t), conf, voted, verified)
    best = max(able, key=lambda i: (key[i], -i))
    rest = [s for s in ranked_samples(samples, t) if s is not samples[best]]
    return Decision(t, samples[best].canonical, [samples[best], *rest], conf, voted, verified)
