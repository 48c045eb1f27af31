"""``mixture_of_agents``: proposers answer concurrently, an aggregator synthesises (docs/methods.md §4).

With ``layers`` > 1, each later layer's proposers also get the previous layer's answers in their system
prompt. The aggregator (a served model, default: the first member) receives the last layer's answers in
its system prompt and writes the final answer, which is streamed token by token.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from chorus.engines.base import Delta
from chorus.ensembles.base import Strategy
from chorus.ensembles.call import Call, Member, gather, resolve_members
from chorus.ensembles.spec import MemberSpec

AGGREGATE = ("You have been given responses from several models to the user's latest message. Synthesise them "
             "into one high-quality answer. Evaluate them critically: some may be biased or incorrect. Do not "
             "simply copy one; write an accurate, well-structured and complete reply.\n\nResponses:")


def with_references(
    messages: list[dict[str, Any]], answers: list[str], instruction: str = AGGREGATE
) -> list[dict[str, Any]]:
    """The messages with the answers in the system prompt (appended to an existing one)."""
    refs = instruction + "".join(f"\n\n{i + 1}. {a}" for i, a in enumerate(answers))
    system = [m for m in messages if m.get("role") in ("system", "developer")]
    rest = [m for m in messages if m.get("role") not in ("system", "developer")]
    own = "\n\n".join(str(m.get("content") or "") for m in system)
    return [{"role": "system", "content": f"{own}\n\n{refs}" if own else refs}, *rest]


class MoAParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    aggregator: str | MemberSpec | None = Field(
        default=None, description="model (or member object); default: the first member"
    )
    layers: int = Field(default=1, ge=1, le=4)
    aggregate_prompt: str = Field(default=AGGREGATE, description="system prompt before the numbered answers")


class MixtureOfAgents(Strategy):
    Params = MoAParams
    supports_logprobs = True  # the aggregator's tokens

    def check(self) -> None:
        agg = self.params.aggregator
        spec = agg if isinstance(agg, MemberSpec) else MemberSpec(model=agg or self.members[0].spec.model)
        spec = spec.model_copy(update={"name": spec.name or f"aggregator:{spec.model}"})
        self.aggregator: Member = resolve_members([spec], self.engines)[0]
        self.aggregator.index = len(self.members)

    def precheck(self, call: Call) -> None:
        super().precheck(call)
        call.request(self.aggregator)

    def models(self) -> list[str]:
        return [*super().models(), self.aggregator.spec.model]

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "aggregator": {"label": self.aggregator.label, "model": self.aggregator.spec.model},
        }

    async def stream(self, call: Call) -> AsyncGenerator[Delta, None]:
        messages = call.prompt.as_messages()
        layers: list[list[dict[str, Any]]] = []
        call.trace["layers"] = layers
        answers: list[str] = []
        prompt = self.params.aggregate_prompt
        for layer in range(self.params.layers):
            gens = await gather(
                *(
                    call.generate(
                        m,
                        m.persona(messages) if layer == 0 else with_references(m.persona(messages), answers, prompt),
                        persona=False,
                        n=1,
                        logprobs=False,
                        top_logprobs=0,
                        constraint=None,
                    )
                    for m in self.members
                )
            )  # proposals are free text; a response format applies to the aggregate
            alive = call.survivors(gens, self.members)
            answers = [g.choices[0].text for _, g in alive]
            layers.append([{"member": m.label, "text": g.choices[0].text} for m, g in alive])
        final = with_references(self.aggregator.persona(messages), answers, prompt)
        async for d in call.stream(self.aggregator, final, persona=False):
            yield d
        call.trace["winner"] = {"member": self.aggregator.label}
        call.trace["reason"] = f"aggregator synthesised {len(answers)} proposals from {self.params.layers} layer(s)"
