"""``route``: one member answers each request; a router picks which (and the trace says why).

The routers (``router:``) are in a registry of their own, one module each (ensembles/routers/): ``random``
(weighted, seeded), ``semantic`` (nearest labelled example prompts), ``cost`` (difficulty score against
thresholds, cheap to expensive) and ``learned`` (a trained router's predicted accuracy per member). A parameter
of another router than the one named is a 400 naming it. The chosen member's answer streams token by token
(``n``, ``logprobs`` as for that model).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any

from chorus.engines.core.base import Delta
from chorus.ensembles.base import Ensemble, Strategy
from chorus.ensembles.call import Call, Member
from chorus.ensembles.choice_scores import ChoiceAnswer, ChoiceQuestion
from chorus.ensembles.metrics import ROUTE_DECISIONS
from chorus.ensembles.routers.base import ROUTERS, RouteParams, Router, build_router, router_class
from chorus.errors import InvalidRequest

__all__ = ["ROUTERS", "Route", "RouteParams"]


class Route(Strategy):
    Params = RouteParams
    token_level = True  # one member answers: its tokens stream as made
    default_on_member_error = "fail"

    @classmethod
    def check_links(cls, params: RouteParams, name: str, ensembles: set[str], metrics: set[str]) -> None:
        router_class(params.router).check_links(params.router_params(), name, ensembles, metrics)

    def check(self) -> None:
        self.router: Router = build_router(self.params, self.members)
        if self.router.learns_online and self.ensemble.startswith("inline:"):
            raise InvalidRequest(f"router: {self.params.router} learns across requests: serve it as a named "
                                 "ensemble in the config (a request body cannot give one).", param="ensemble.router")

    def bind(self, named: dict[str, Ensemble], outcomes: Any) -> None:
        self.router.bind(self.ensemble, named, outcomes)

    def feedback_metric(self) -> str | None:
        return self.router.feedback_metric()

    async def learn(self, decision: dict[str, Any], quality: float, tokens: int, price: float) -> bool:
        return await self.router.learn(decision, quality, tokens, price)

    async def warm(self) -> None:
        """Embed the router's examples (once; named ensembles do it at start-up)."""
        await self.router.warm()

    async def score_choices(self, call: Call, question: ChoiceQuestion, combine: str | None) -> ChoiceAnswer:
        """A router that scores choices (learned) answers a multiple-choice question with the one member it picks
        from the prompt; the other routers average every member (the base behaviour)."""
        if not self.router.scores_choices:
            return await super().score_choices(call, question, combine)
        if question.text is None:
            raise InvalidRequest(f"A {self.params.router} router reads a text 'prompt', not chat 'messages'.",
                                 param="messages")
        member, why = await self.router.choose_text(question.text)
        ROUTE_DECISIONS.labels(self.ensemble, self.params.router, member.label).inc()
        answer, tokens = await question.answer(member.engine, scope=call.scope)
        call.record(member, tokens, 0)
        answer.trace = {"router": self.params.router, **why, "winner": {"member": member.label}}
        return answer

    async def stream(self, call: Call) -> AsyncGenerator[Delta, None]:
        seed = call.sampling({}).seed
        arm, why = await self.router.choose(call, seed)
        if isinstance(arm, Member):
            ROUTE_DECISIONS.labels(self.ensemble, self.params.router, arm.label).inc()
            call.trace.update({"router": self.params.router, **why, "winner": {"member": arm.label}})
            async for d in call.stream(arm):
                yield d
            return
        name = arm.strategy.ensemble  # a named ensemble is the arm (router: online): it answers as itself
        ROUTE_DECISIONS.labels(self.ensemble, self.params.router, name).inc()
        call.trace.update({"router": self.params.router, **why, "winner": {"ensemble": name}})
        async for d in run_arm(call, arm, name):
            yield d


async def run_arm(call: Call, arm: Ensemble, name: str) -> AsyncGenerator[Delta, None]:
    """The named ensemble ``arm`` answers ``call``'s prompt with its own strategy; its members' usage is added to
    the call under ``NAME/LABEL`` (each charged to its own model) and its trace goes under ``arm_trace``."""
    sub = arm.call(call.prompt, call.sampling, n=call.n, logprobs=call.logprobs)
    try:
        async for d in arm.strategy.stream(sub):
            yield d
    finally:
        for m in sub.members:
            call.members.append(replace(m, label=f"{name}/{m.label}"))
        for label, u in sub.by_member.items():
            call.by_member[f"{name}/{label}"] = u
            if label in sub.model_of:  # (an arm's judge too)
                call.model_of[f"{name}/{label}"] = sub.model_of[label]
        call.usage.add(sub.usage.prompt_tokens, sub.usage.completion_tokens, sub.usage.calls, sub.usage.cached_tokens)
        call.trace["arm_trace"] = sub.final_trace()
