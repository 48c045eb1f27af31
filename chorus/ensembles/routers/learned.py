"""``router: learned``: a router trained by ``chorus bench selector`` (fitted/learned_router.py) predicts from the
prompt how likely each member is to be right and sends it to the cheapest member within ``margin`` of the best.
It also answers ``/v1/choices`` with the one member it picks."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from chorus.ensembles.call import Call, Member
from chorus.ensembles.fitted.artifact import load_trained
from chorus.ensembles.fitted.learned_router import LearnedRouter
from chorus.ensembles.routers.base import Router
from chorus.ensembles.similarity import Embedder
from chorus.errors import InvalidRequest


def load_router(name: str | None, members: list[str]) -> LearnedRouter:
    if not name:
        raise InvalidRequest("router: learned needs 'artifact' (a router trained by `chorus bench selector`).",
                             param="ensemble.artifact")
    router = load_trained(LearnedRouter, name, members, "router")
    return router


class LearnedParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    artifact: str | None = Field(default=None, description="a router trained by chorus bench selector")
    margin: float | None = Field(default=None, ge=0.0, le=1.0,
                                 description="predicted-accuracy margin for a cheaper member (the artifact's)")


class LearnedRouting(Router):
    Params = LearnedParams
    scores_choices = True

    def __init__(self, params: LearnedParams, members: list[Member]) -> None:
        super().__init__(params, members)
        self.learned = load_router(params.artifact, [m.spec.model for m in members])

    async def choose(self, call: Call, seed: int | None) -> tuple[Member, dict[str, Any]]:
        return await self.choose_text(call.prompt.question)

    async def choose_text(self, text: str) -> tuple[Member, dict[str, Any]]:
        r = self.learned
        q = (await asyncio.to_thread(Embedder.embed, [text]))[0]
        pred, nearest, sims = r.predict(q)
        i = r.choose(pred, self.params.margin)
        margin = r.margin if self.params.margin is None else self.params.margin
        info = {"predicted_correct": {m.label: round(float(x), 4) for m, x in zip(self.members, pred)},
                "neighbours": [{"item": int(j), "similarity": round(float(s), 4)} for j, s in zip(nearest, sims)],
                "margin": margin, "fallback": r.fallback,
                "reason": (f"fallback to {r.fallback}: {r.training.get('fallback_reason')}" if r.fallback else
                           f"the cheapest member predicted within {margin} of the best")}
        return self.members[i], info
