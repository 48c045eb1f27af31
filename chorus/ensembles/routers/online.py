"""``router: online``: learns from feedback which arm answers which prompt: the members (models, each with its own
sampling) and named ``ensembles`` (a vote, a cascade, ...) are its arms.

Each request: the prompt's last user message is embedded (MiniLM), the events other requests' feedback added to
the shared outcome log since the last request are learned (routers/outcomes.py), and the policy picks an arm
(routers/bandit.py: the safe start, then a per-arm ridge regression with a confidence bonus and decaying
exploration). The decision (arm, features, propensity, whether it explored) goes into the call, the gateway keeps
it with the request id, and ``POST /v1/feedback`` on ``metric`` for that request turns it into a reward (the
value minus ``cost_weight`` x the request's cost) appended to the log. The trace shows the arm, every arm's
score and whether it explored; Prometheus counts decisions, explorations, feedbacks and rewards per arm.

A restarted gateway learns the whole log at start-up (`warm`), before its first request; if the log cannot be
read (Redis out of reach), a request is routed with what was learned so far. Learning across requests needs a
name: an online router is served from the config only (a request body cannot
give one, or change a named one: it would start from nothing each time).
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from prometheus_client import Counter, Summary
from pydantic import BaseModel, ConfigDict, Field

from chorus.ensembles.call import Call, Member
from chorus.ensembles.routers.bandit import OnlinePolicy, PolicyParams, features, projection
from chorus.ensembles.routers.base import Router
from chorus.ensembles.routers.outcomes import Outcomes
from chorus.ensembles.similarity import Embedder
from chorus.errors import ConfigError, InvalidRequest

if TYPE_CHECKING:
    from chorus.ensembles.base import Ensemble

log = logging.getLogger("chorus.online")
DECISIONS = Counter("chorus_online_decisions_total", "requests an online router sent to each arm",
                    ["ensemble", "arm", "phase", "explored"])
FEEDBACKS = Counter("chorus_online_feedback_total", "feedbacks an online router learned from, per arm",
                    ["ensemble", "arm"])
REWARDS = Summary("chorus_online_reward", "the rewards an online router learned, per arm", ["ensemble", "arm"])

class OnlineParams(BaseModel):
    """Arms are the members and ``ensembles``; the policy's parameters default to routers/bandit.py's."""

    model_config = ConfigDict(extra="forbid")

    ensembles: list[str] | None = Field(default=None, description="named ensembles that are arms too")
    metric: str | None = Field(default=None, description="the feedback metric it learns from (required)")
    cost_weight: float | None = Field(default=None, ge=0.0, description="reward minus this x cost (0)")
    cost: Literal["tokens", "price"] | None = Field(
        default=None, description="cost in thousands of tokens, or by the config's prices (tokens)")
    alpha: float | None = Field(default=None, ge=0.0, description="confidence bonus weight (0.3)")
    explore: float | None = Field(default=None, ge=0.0, le=1.0, description="first exploration rate (0.1)")
    explore_half_life: float | None = Field(default=None, gt=0.0, description="feedbacks until exploration halves (200)")
    explore_floor: float | None = Field(default=None, ge=0.0, le=1.0, description="exploration never below this (0.02)")
    warmup: int | None = Field(default=None, ge=0, description="feedbacks before it chooses (30)")
    discount: float | None = Field(default=None, gt=0.0, le=1.0,
                                   description="weight kept by old evidence per update (1: all)")
    dims: int | None = Field(default=None, ge=0, le=384, description="embedding projected to this many numbers (0: all 384)")
    default: str | None = Field(default=None, description="the arm of the safe start (first)")


def policy_params(p: OnlineParams) -> PolicyParams:
    """The policy's parameters: the ensemble's where given, else the documented defaults."""
    given = {f: getattr(p, f) for f in ("alpha", "explore", "explore_half_life", "explore_floor", "warmup",
                                        "discount") if getattr(p, f) is not None}
    return PolicyParams(**given)


class OnlineRouter(Router):
    Params = OnlineParams
    learns_online = True

    def __init__(self, params: OnlineParams, members: list[Member]) -> None:
        super().__init__(params, members)
        if not params.metric:
            raise InvalidRequest("router: online needs 'metric': the feedback metric it learns from.",
                                 param="ensemble.metric")
        self.labels = [m.label for m in members] + list(params.ensembles or [])
        if len(set(self.labels)) != len(self.labels):
            raise InvalidRequest(f"router: online: arm names must differ (members' labels and ensembles): "
                                 f"{', '.join(self.labels)}.", param="ensemble.ensembles")
        if params.default is not None and params.default not in self.labels:
            raise InvalidRequest(f"'default' {params.default!r} is not an arm; arms: {', '.join(self.labels)}.",
                                 param="ensemble.default")
        self.default = self.labels.index(params.default) if params.default else 0
        self.proj = projection(params.dims or 0)
        dims = (self.proj.shape[1] if self.proj is not None else 384) + 1
        self.policy = OnlinePolicy(len(self.labels), dims, policy_params(params), self.default)
        self.cost_weight = params.cost_weight or 0.0
        self.cost = params.cost or "tokens"
        self.rng = random.Random()
        self.name: str | None = None  # the named ensemble, once bound
        self.arms: list[Member | Ensemble] = list(members)
        self.outcomes: Outcomes | None = None
        self.cursor: str | None = None
        self._sync = asyncio.Lock()

    @classmethod
    def check_links(cls, params: OnlineParams, name: str, ensembles: set[str], metrics: set[str]) -> None:
        if not params.metric:
            raise InvalidRequest("router: online needs 'metric': the feedback metric it learns from.",
                                 param="ensemble.metric")
        if params.metric not in metrics:
            raise InvalidRequest(f"router: online learns from the feedback metric {params.metric!r}, which "
                                 f"server.feedback.metrics does not declare (declared: "
                                 f"{', '.join(sorted(metrics)) or 'none'}).", param="ensemble.metric")
        unknown = [e for e in params.ensembles or [] if e not in ensembles or e == name]
        if unknown:
            raise InvalidRequest(f"router: online: arm(s) {', '.join(unknown)} must be other named ensembles of "
                                 "the config.", param="ensemble.ensembles")

    def bind(self, ensemble: str, named: dict[str, Any], outcomes: Outcomes) -> None:
        for e in self.params.ensembles or []:
            target = named.get(e)
            if target is None:
                raise ConfigError(f"ensemble {ensemble!r}: online arm {e!r} is not a named ensemble; named: "
                                  f"{', '.join(sorted(n for n in named if n != ensemble)) or 'none'}")
            if e == ensemble or target.strategy.feedback_metric() is not None:
                raise ConfigError(f"ensemble {ensemble!r}: online arm {e!r} is itself an online router")
            self.arms.append(target)
        self.name, self.outcomes = ensemble, outcomes

    def feedback_metric(self) -> str | None:
        return self.params.metric

    async def warm(self) -> None:
        """At start-up (named ensembles, once bound): learn the whole shared log before the first request."""
        if self.outcomes is not None:
            await self.catch_up()

    async def catch_up(self) -> None:
        """Learn the events appended to the shared log since the last look (by any replica). If the log cannot be
        read (Redis out of reach), it chooses with what it has learned so far and says so in the log."""
        assert self.outcomes is not None and self.name is not None
        async with self._sync:
            try:
                events, self.cursor = await self.outcomes.read(self.name, self.cursor)
            except Exception as exc:
                log.warning("online router %s: the outcome log cannot be read (%s); choosing with what it has "
                            "learned", self.name, exc)
                return
            for e in events:
                if e.get("arm") in self.labels:  # an arm since removed from the config is skipped
                    self.policy.learn(self.labels.index(e["arm"]), np.asarray(e["x"]), float(e["reward"]))

    async def choose(self, call: Call, seed: int | None) -> tuple[Any, dict[str, Any]]:
        if self.name is None or self.outcomes is None:
            raise InvalidRequest("router: online learns across requests: serve it as a named ensemble in the "
                                 "config (a request body cannot give one or change a named one).",
                                 param="ensemble.router")
        await self.catch_up()
        emb = await asyncio.to_thread(Embedder.embed, [call.prompt.question])
        x = features(emb[0], self.proj)
        d = self.policy.choose(x, random.Random(seed) if seed is not None else self.rng)
        arm = self.labels[d.arm]
        DECISIONS.labels(self.name, arm, d.phase, str(d.explored).lower()).inc()
        call.decision = {"ensemble": self.name, "router": "online", "arm": arm, "metric": self.params.metric,
                         "propensity": round(d.propensity, 6), "explored": d.explored,
                         "x": [round(float(v), 4) for v in x]}
        why = {"arm": arm, "phase": d.phase, "explored": d.explored, "propensity": round(d.propensity, 4),
               "scores": None if d.scores is None else dict(zip(self.labels, d.scores)),
               **self.policy.describe(),
               "reason": (f"{d.phase}: " + ("explored (uniform draw)" if d.explored else
                                            "the default arm" if d.scores is None else "the best score"))}
        return self.arms[d.arm], why

    async def learn(self, decision: dict[str, Any], quality: float, tokens: int, price: float) -> bool:
        """Append the reward for ``decision`` to the shared log (every replica learns it before its next choice)."""
        if self.outcomes is None or self.name is None or decision.get("arm") not in self.labels:
            return False
        cost = tokens / 1000.0 if self.cost == "tokens" else price
        reward = quality - self.cost_weight * cost
        await self.outcomes.append(self.name, {"arm": decision["arm"], "x": decision["x"], "reward": reward})
        FEEDBACKS.labels(self.name, decision["arm"]).inc()
        REWARDS.labels(self.name, decision["arm"]).observe(reward)
        return True
