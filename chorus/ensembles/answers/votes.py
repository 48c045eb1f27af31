"""Voting on the members' *answers*: the pure parts every answer-side strategy shares (served strategies and the
offline evidence replay call the same functions, so a table and a served request decide alike).

- `Sample`: one sampled reply: its member, text, extracted answer (by the answer kinds of `kinds`), the
  canonical answer it counts for, its mean token log-probability and tokens.
- `tally`: the histogram of canonical answers. The winner has the most weight (each sample counts its member's
  weight; equal weights by default, so: the most samples); a tie goes to the answer whose samples have the
  higher mean token log-probability, then to the answer seen first. Samples with no extractable answer do not
  vote, and neither (``unfinished: abstain``, the default) do samples cut at ``max_tokens`` while another sample
  finished: a cut chain of thought has not reached its answer, and its last number is mostly wrong (on GSM8K's
  train items 4% of the 0.5B's and 12% of the 1.5B's cut samples were right, against 22% and 70% of the
  finished ones). When every sample was cut they all vote (``unfinished: vote``: always).
- `best_sample`: the reply a user sees: the winning answer's sample with the highest mean log-probability (its
  whole text, reasoning included), a finished sample before one cut at ``max_tokens`` (whose text ends
  mid-sentence).
- Stopping rules for adaptive sampling (`settled`), checked after each batch of samples:
  - ``majority``: stop when the remaining samples cannot change the winner (its lead is larger than what is
    left to draw);
  - ``beta`` (Adaptive-Consistency, Aggarwal et al. 2023): with the two leading counts ``v1 >= v2``, stop when
    ``P(p1 > p2) >= confidence`` under ``p ~ Beta(v1 + 1, v2 + 1)`` (the leader's share among the two); the
    ``majority`` rule also applies;
  - ``agree``: stop as soon as every vote so far gives one answer and there are at least two of them (answer_vote's
    greedy answer and one sample that agrees with it: the cheap case of Adaptive-Consistency); once they
    disagree, the ``majority`` rule;
  - ``none``: draw every sample.
- `agreement`: the share of a member's voting samples that give its majority answer (the confidence of
  consistency-based selection and of the agreement cascade).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from scipy import stats

from chorus.ensembles.answers.confidence import Tokens

StopRule = Literal["none", "majority", "beta", "agree"]
STOP_RULES: tuple[str, ...] = ("none", "majority", "beta", "agree")
Unfinished = Literal["abstain", "vote"]


@dataclass
class Sample:
    member: str
    text: str
    answer: str  # as extracted ("" when none)
    canonical: str = ""  # the answer it counts for ("" when none)
    mean_logprob: float | None = None
    tokens: int = 0
    finish_reason: str = "stop"
    per_token: Tokens | None = None  # its tokens' log-probabilities and confidences (`confidence`), when read
    weight: float = 1.0  # its vote's weight on top of its member's (a confidence or a verifier's score)
    greedy: bool = False  # drawn at temperature 0 (answer_vote's ``greedy: true``)

    def __post_init__(self) -> None:
        if not self.canonical:
            self.canonical = self.answer

    @property
    def cut(self) -> bool:
        """Stopped by ``max_tokens`` before it finished."""
        return self.finish_reason == "length"


def from_answers(answers: Sequence[str], member: str = "", finished: Sequence[bool] | None = None) -> list[Sample]:
    """Bare extracted answers (no text, no log-probabilities) as samples: what offline replays and fits vote on;
    ``finished``: whether each one ended on its own (else it was cut at max_tokens; default: all finished)."""
    done = list(finished) if finished is not None else [True] * len(answers)
    return [Sample(member, "", a, finish_reason="stop" if f else "length") for a, f in zip(answers, done, strict=True)]


@dataclass
class Tally:
    """The histogram of answers (canonical answer -> weight, in first-seen order) and its winner."""

    counts: dict[str, float] = field(default_factory=dict)
    votes: int = 0  # samples that voted
    drawn: int = 0  # samples in all
    abstained: int = 0  # samples with an answer that did not vote: cut at max_tokens while another finished
    winner: str = ""  # "" when no sample gave an answer
    tie_broken_by: str | None = None  # None, "log-probability" or "first seen"

    def ranked(self) -> list[tuple[str, float]]:
        return sorted(self.counts.items(), key=lambda kv: -kv[1])


def mean_logprob(logprobs: Sequence[float]) -> float | None:
    return sum(logprobs) / len(logprobs) if logprobs else None


def _lp(s: Sample) -> float:
    return s.mean_logprob if s.mean_logprob is not None else float("-inf")


def tally(samples: Sequence[Sample], weights: dict[str, float] | None = None,
          unfinished: Unfinished = "abstain") -> Tally:
    t = Tally(drawn=len(samples))
    quality: dict[str, list[float]] = {}
    skip_cut = unfinished == "abstain" and any(s.canonical and not s.cut for s in samples)
    for s in samples:
        if not s.canonical:
            continue
        if skip_cut and s.cut:
            t.abstained += 1
            continue
        t.votes += 1
        t.counts[s.canonical] = t.counts.get(s.canonical, 0.0) + (weights or {}).get(s.member, 1.0) * s.weight
        quality.setdefault(s.canonical, []).append(_lp(s))
    if not t.counts:
        return t
    top = max(t.counts.values())
    leaders = [a for a, c in t.counts.items() if abs(c - top) < 1e-12]  # first seen first
    if len(leaders) == 1:
        t.winner = leaders[0]
        return t

    def mean(a: str) -> float:
        q = quality[a]
        return sum(q) / len(q)

    best = max(mean(a) for a in leaders)
    by_lp = [a for a in leaders if mean(a) == best]
    t.winner = by_lp[0]
    t.tie_broken_by = "log-probability" if len(by_lp) == 1 and best > float("-inf") else "first seen"
    return t


def best_sample(samples: Sequence[Sample], answer: str) -> Sample | None:
    """The sample of ``answer`` with the highest mean log-probability (the first of them on a tie), a finished
    sample before a cut one."""
    ofs = [s for s in samples if s.canonical == answer and answer]
    return max(ofs, key=lambda s: (not s.cut, _lp(s))) if ofs else None


def ranked_samples(samples: Sequence[Sample], t: Tally) -> list[Sample]:
    """Every sample, best first: the winner's best, then each other answer's best in vote order, then the rest
    (the ``n`` choices of a request: distinct answers first)."""
    order = {a: i for i, (a, _) in enumerate(t.ranked())}
    if t.winner:
        order[t.winner] = -1
    firsts = [b for a in sorted(order, key=lambda a: order[a]) if (b := best_sample(samples, a)) is not None]
    rest = sorted((s for s in samples if all(s is not f for f in firsts)),
                  key=lambda s: (order.get(s.canonical, len(order)), -_lp(s)))
    return firsts + rest


def agreement(samples: Sequence[Sample], t: Tally | None = None) -> tuple[float, str]:
    """(share of the samples that give the majority answer, that answer); (0, "") when none gave one. The share
    is over every sample drawn: a sample with no answer, or one that abstained, counts against agreement.
    ``t``: their tally, if made (default: `tally`'s default rule)."""
    t = t if t is not None else tally(samples)
    if not t.winner or not samples:
        return 0.0, ""
    return t.counts[t.winner] / len(samples), t.winner


def beta_confidence(v1: float, v2: float) -> float:
    """P(p1 > p2) for the two leading answers' counts, p1 / (p1 + p2) ~ Beta(v1 + 1, v2 + 1)."""
    return float(stats.beta.sf(0.5, v1 + 1, v2 + 1))


def settled(t: Tally, remaining: float, rule: str, confidence: float = 0.95) -> tuple[bool, str]:
    """(stop now, why) after a batch: ``remaining``: the votes left to draw (samples times their weight)."""
    if remaining <= 0:
        return True, "every sample drawn"
    if rule == "none" or not t.winner:
        return False, ""
    ranked = t.ranked()
    v1 = ranked[0][1]
    v2 = ranked[1][1] if len(ranked) > 1 else 0.0
    if v1 - v2 > remaining:
        return True, f"the lead ({v1:g} to {v2:g}) is larger than the {remaining:g} votes left"
    if rule == "agree" and len(ranked) == 1 and v1 >= 2:
        return True, f"the {v1:g} votes so far agree"
    if rule == "beta":
        p = beta_confidence(v1, v2)
        if p >= confidence:
            return True, f"Beta rule: P(leader is the majority) = {p:.3f} >= {confidence}"
    return False, ""
