"""``router: random``: a weighted choice (A/B splits, canaries); the request's ``seed`` makes it reproducible."""

from __future__ import annotations

import random
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from chorus.ensembles.call import Call, Member
from chorus.ensembles.routers.base import Router
from chorus.errors import InvalidRequest


class RandomParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weights: list[float] | None = Field(default=None, description="one per member (default equal)")


class RandomRouter(Router):
    Params = RandomParams

    def __init__(self, params: RandomParams, members: list[Member]) -> None:
        super().__init__(params, members)
        n = len(members)
        w = params.weights
        if w is not None and (len(w) != n or any(x < 0 for x in w) or sum(w) <= 0):
            raise InvalidRequest(f"'weights' must be {n} non-negative numbers (one per member) with a positive sum.",
                                 param="ensemble.weights")
        self.weights = w or [1.0] * n

    async def choose(self, call: Call, seed: int | None) -> tuple[Member, dict[str, Any]]:
        m = random.Random(seed).choices(self.members, weights=self.weights)[0]
        return m, {"weights": self.weights,
                   "reason": "weighted random choice" + (f" (seed {seed})" if seed is not None else "")}
