"""``router: cost``: members ordered cheap to expensive; the request's score is its mean similarity to its k nearest
``hard_examples`` (minus the same for ``easy_examples`` when given), and the ``thresholds`` (one fewer than
members, ascending) split the score range: score >= thresholds[i] goes to member i + 1 or beyond (RouteLLM's
strong / weak pair, generalised). `chorus route calibrate` sets the thresholds for a target share of calls."""

from __future__ import annotations

import asyncio
import bisect
import itertools
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from chorus.ensembles.call import Call, Member
from chorus.ensembles.routers.base import ExampleRouter
from chorus.ensembles.similarity import Embedder
from chorus.errors import InvalidRequest


def knn_similarity(query: np.ndarray, examples: np.ndarray, k: int) -> float:
    """Mean cosine of the k nearest examples. query (384,), examples (E, 384)."""
    sims = examples @ query  # (E,)
    return float(np.sort(sims)[-k:].mean())


def difficulty(query: np.ndarray, hard: np.ndarray, easy: np.ndarray | None, k: int) -> float:
    """The cost router's score: nearness to hard examples, minus nearness to easy ones when given."""
    s = knn_similarity(query, hard, k)
    return s - knn_similarity(query, easy, k) if easy is not None else s


class CostParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hard_examples: list[str] | None = Field(default=None, description="prompts that need a strong model")
    easy_examples: list[str] | None = Field(default=None, description="prompts a weak model handles")
    thresholds: list[float] | None = Field(default=None, description="ascending, one fewer than members")
    k: int = Field(default=5, ge=1, le=100, description="nearest examples that count")

    @field_validator("thresholds")
    @classmethod
    def _ascending(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and any(b < a for a, b in itertools.pairwise(v)):
            raise ValueError("thresholds must be in ascending order (members go cheap to expensive)")
        return v


class CostRouter(ExampleRouter):
    Params = CostParams

    def __init__(self, params: CostParams, members: list[Member]) -> None:
        super().__init__(params, members)
        n = len(members)
        if not params.hard_examples:
            raise InvalidRequest("the cost router needs 'hard_examples' (prompts that need the stronger model).",
                                 param="ensemble.hard_examples")
        if params.thresholds is None or len(params.thresholds) != n - 1:
            raise InvalidRequest(f"the cost router needs 'thresholds': {n - 1} ascending number(s) for {n} members "
                                 "ordered cheap to expensive (`chorus route calibrate` computes them).",
                                 param="ensemble.thresholds")
        self.thresholds = params.thresholds
        self.examples = {"hard": params.hard_examples,
                         **({"easy": params.easy_examples} if params.easy_examples else {})}

    async def score(self, text: str) -> float:
        """The difficulty score of a prompt."""
        embedded = await self.embedded()
        q = (await asyncio.to_thread(Embedder.embed, [text]))[0]
        return difficulty(q, embedded["hard"], embedded.get("easy"), self.params.k)

    async def choose(self, call: Call, seed: int | None) -> tuple[Member, dict[str, Any]]:
        score = await self.score(call.prompt.question)
        i = bisect.bisect_right(self.thresholds, score)
        return self.members[i], {"score": score, "thresholds": self.thresholds,
                                 "reason": f"difficulty score {score:.4f} -> member {i} (cheap to expensive)"}
