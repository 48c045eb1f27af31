"""``route``: one member answers each request; a router picks which (and the trace says why).

The routers (``router:``) are in a registry of their own, one module each (ensembles/routers/): ``random``
(weighted, seeded), ``semantic`` (nearest labelled example prompts), ``cost`` (difficulty score against
thresholds, cheap to expensive) and ``learned`` (a trained router's predicted accuracy per member). A parameter
of another router than the one named is a 400 naming it. The chosen member's answer streams token by token
(``n``, ``logprobs`` as for that model).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from chorus.engines.core.base import Delta
from chorus.ensembles.base import Strategy
from chorus.ensembles.call import Call
from chorus.ensembles.choice_scores import ChoiceAnswer, ChoiceQuestion
from chorus.ensembles.metrics import ROUTE_DECISIONS
from chorus.ensembles.routers.base import ROUTERS, RouteParams, Router, build_router
from chorus.errors import InvalidRequest

__all__ = ["ROUTERS", "Route", "RouteParams"]


class Route(Strategy):
    Params = RouteParams
    token_level = True  # one member answers: its tokens stream as made
    default_on_member_error = "fail"

    def check(self) -> None:
        self.router: Router = build_router(self.params, self.members)

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
        answer, tokens = await question.answer(member.engine)
        call.record(member, tokens, 0)
        answer.trace = {"router": self.params.router, **why, "winner": {"member": member.label}}
        return answer

    async def stream(self, call: Call) -> AsyncGenerator[Delta, None]:
        seed = call.sampling({}).seed
        member, why = await self.router.choose(call, seed)
        ROUTE_DECISIONS.labels(self.ensemble, self.params.router, member.label).inc()
        call.trace.update({"router": self.params.router, **why, "winner": {"member": member.label}})
        async for d in call.stream(member):
            yield d
