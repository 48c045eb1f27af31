"""``crowd_vote``: pick the candidate most similar to the others (docs/methods.md §3).

Candidates come from the members (``samples_per_member`` each, at ``temperature`` if given) or from
the request (``candidates: [...]``, to score external answers; then no member is called). Score
``q_i = sum_{j != i} s(i, j)``; the answer is argmax q, ties to the lowest index. ``metric`` picks one
similarity; ``weights`` mixes several (chorus's addition; the published method uses one).

Structured outputs: every member answer is constrained, and the vote is among the complete ones (those
the grammar finished; an answer cut by ``max_tokens`` may not parse). External candidates cannot be
checked against a format: the request is refused. With functions offered, an answer that calls them is
voted on as its calls (name and arguments, in one canonical JSON form), whatever format the member wrote.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from chorus.engines.core import tool_calls
from chorus.engines.core.base import Delta
from chorus.ensembles.base import Budget, Strategy
from chorus.ensembles.call import Call, gather
from chorus.ensembles.similarity import METRICS, crowd_scores, similarity
from chorus.errors import InvalidRequest

Metric = Literal["embedding_cosine", "word_rouge_l", "char_rouge_l"]


class CrowdVoteParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    metric: Metric = "embedding_cosine"
    weights: dict[Metric, float] | None = Field(default=None, description="mix of metrics, e.g. {word_rouge_l: 1}")
    samples_per_member: int = Field(default=1, ge=1, le=16)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, description="sampling temperature of candidates")
    candidates: list[str] | None = Field(default=None, description="score these answers instead of calling members")

    @field_validator("weights")
    @classmethod
    def _weights(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is not None and (not v or any(w < 0 for w in v.values()) or sum(v.values()) <= 0):
            raise ValueError(f"weights must be non-negative with a positive sum, over {', '.join(METRICS)}")
        return v

    @model_validator(mode="after")
    def _candidates(self) -> CrowdVoteParams:
        if self.candidates is not None and not self.candidates:
            raise ValueError("candidates must not be empty")
        return self

    def mix(self) -> dict[str, float]:
        w = self.weights or {self.metric: 1.0}
        total = sum(w.values())
        return {m: x / total for m, x in w.items() if x > 0}


def vote(texts: list[str], mix: dict[str, float]) -> tuple[int, np.ndarray, dict[str, list[float]], np.ndarray]:
    """(winner, combined scores, per-metric scores, the weighted similarity matrix whose off-diagonal row sums
    are the combined scores). Blocking (embeddings): run it in a thread."""
    sims = {m: similarity(m, texts) for m in mix}
    per_metric = {m: crowd_scores(s) for m, s in sims.items()}
    q: np.ndarray = np.sum([w * per_metric[m] for m, w in mix.items()], axis=0)
    matrix: np.ndarray = np.sum([w * sims[m] for m, w in mix.items()], axis=0)
    return int(np.argmax(q)), q, {m: s.tolist() for m, s in per_metric.items()}, matrix  # argmax: first of ties


class CrowdVote(Strategy):
    Params = CrowdVoteParams

    @classmethod
    def member_minimum(cls, params: CrowdVoteParams) -> int:
        return 0 if params.candidates is not None else 2  # external candidates need no member

    def budget(self) -> Budget:
        p = self.params
        return Budget(candidates=len(p.candidates) if p.candidates is not None
                      else p.samples_per_member * len(self.members))

    def precheck(self, call: Call) -> None:
        if self.params.candidates is None:
            super().precheck(call)
        elif call.sampling({}).constraint is not None:
            raise InvalidRequest("crowd_vote with external 'candidates' scores them as given; it cannot apply "
                                 "a response format to them.", param="response_format")

    async def stream(self, call: Call) -> AsyncGenerator[Delta, None]:
        p = self.params
        asked = call.sampling({})
        offered = asked.tools
        formatted = asked.constraint is not None or (offered is not None and offered.choice != "auto")
        if p.candidates is not None:
            sources = [{"member": None, "text": t, "finish_reason": "stop"} for t in p.candidates]
        else:
            over = {"n": p.samples_per_member} | ({"temperature": p.temperature} if p.temperature is not None else {})
            gens = await gather(*(call.generate(m, **over) for m in self.members))
            sources = [{"member": m.label, "text": c.text, "finish_reason": c.finish_reason}
                       for m, g in call.survivors(gens, self.members) for c in g.choices]
            if formatted:  # vote among the answers the grammar completed (a format, or a forced call)
                complete = [s for s in sources if s["finish_reason"] == "stop"]
                sources = complete or sources
        if offered is not None:  # calls as structured objects: equal name and arguments, equal text
            for s in sources:
                s["text"] = tool_calls.canonical(s["text"], offered)
        texts = [s["text"] for s in sources]
        mix = p.mix()
        winner, q, per_metric, matrix = await asyncio.to_thread(vote, texts, mix)
        call.trace.update({
            "candidates": sources, "metric": mix, "scores": q.tolist(), "scores_by_metric": per_metric,
            "similarity": np.round(matrix, 6).tolist(),
            "winner": {"index": winner, "member": sources[winner]["member"]},
            "reason": f"candidate {winner} has the highest summed similarity to the other {len(texts) - 1} "
                      f"candidates ({' + '.join(f'{w:g} x {m}' for m, w in mix.items())}: {q[winner]:.4f})",
        })
        yield Delta(0, texts[winner], finish_reason=sources[winner]["finish_reason"])
