"""``mixture_of_agents``: proposers answer concurrently, an aggregator (the judge) synthesises (docs/methods.md §4).

With ``layers`` > 1, each later layer's proposers also get the previous layer's answers in their system
prompt. The aggregator (a served model, default: the first member; per request ``aggregator``) receives the
last layer's answers in its system prompt, numbered and without the proposers' names ("1. ...", "2. ...";
``shuffle`` puts them in a seeded random order), and writes the final answer, streamed token by token.

What the fusion products add (docs/ensembles.md):
- ``quorum`` k: a layer goes on once k proposers have replied; the rest get ``grace_s`` more seconds and
  are then cancelled (quorum.py). The trace lists who was waited for and who was late.
- ``skip_judge``: when every proposal of the last layer gives the same answer (compared as
  Exchange-of-Thought compares answers: ``answer`` kind, ``text_threshold``; answers/kinds.py), the first
  of them is the reply and the aggregator is not called.
- ``rationale``: the judge first writes an assessment of the proposals (consensus, contradictions, what is
  best supported); it goes into the trace and into the judge's prompt for the final answer.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import AsyncGenerator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from chorus.engines.core.base import Delta, Generation
from chorus.ensembles import spans
from chorus.ensembles.answers.extract import extract_answer
from chorus.ensembles.answers.kinds import AnswerCanon, answer_kind
from chorus.ensembles.base import Strategy
from chorus.ensembles.call import Call, Member, resolve_members
from chorus.ensembles.quorum import first_k
from chorus.ensembles.spec import MemberSpec
from chorus.errors import InvalidRequest

AGGREGATE = ("You have been given responses from several models to the user's latest message. Synthesise them "
             "into one high-quality answer. Evaluate them critically: some may be biased or incorrect. Do not "
             "simply copy one; write an accurate, well-structured and complete reply.\n\nResponses:")
ASSESS = ("You have been given responses from several models to the user's latest message. Do not answer the "
          "message yourself. Compare the responses: say where they agree, where they contradict each other, "
          "which claims are best supported and which are probably wrong.\n\nResponses:")
ASSESSMENT = "\n\nYour assessment of the responses, written before:\n"


def with_references(
    messages: list[dict[str, Any]], answers: list[str], instruction: str = AGGREGATE, after: str = ""
) -> list[dict[str, Any]]:
    """The messages with the answers in the system prompt (appended to an existing one), numbered as Together
    MoA's reference does and without their authors' names; ``after`` follows them (the judge's assessment)."""
    refs = instruction + "".join(f"\n\n{i + 1}. {a}" for i, a in enumerate(answers)) + after
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
    quorum: int | None = Field(default=None, ge=1, description="go on once this many proposers of a layer replied")
    grace_s: float = Field(default=0.0, ge=0, le=600, description="with a quorum: seconds more for the others")
    skip_judge: bool = Field(default=False, description="no aggregator call when the last layer's proposals agree")
    answer: Literal["number", "choice", "yes_no", "text", "auto"] = Field(
        default="auto", description="skip_judge: how proposals' answers are compared (as Exchange-of-Thought)")
    text_threshold: float | None = Field(default=0.85, ge=-1, le=1, description=(
        "skip_judge on text answers: the embedding cosine at or above which two agree (null: normalised text only)"))
    shuffle: bool = Field(default=False, description="the proposals in the judge's prompt in a seeded random order")
    rationale: bool = Field(default=False, description="the judge assesses the proposals first (one more call)")


class MixtureOfAgents(Strategy):
    Params = MoAParams
    supports_logprobs = True  # the aggregator's tokens

    def check(self) -> None:
        agg = self.params.aggregator
        spec = agg if isinstance(agg, MemberSpec) else MemberSpec(model=agg or self.members[0].spec.model)
        spec = spec.model_copy(update={"name": spec.name or f"aggregator:{spec.model}"})
        self.aggregator: Member = resolve_members([spec], self.engines)[0]
        self.aggregator.index = len(self.members)
        if self.params.quorum is not None and self.params.quorum > len(self.members):
            raise InvalidRequest(f"'quorum' is {self.params.quorum} but the ensemble has {len(self.members)} "
                              "proposers.", param="ensemble.quorum")

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

    async def propose(self, call: Call, layer: int, messages: list[dict[str, Any]], answers: list[str]
                      ) -> list[tuple[Member, Generation]]:
        """One layer's proposals (free text: a response format applies to the aggregate), up to the quorum."""
        prompt = self.params.aggregate_prompt
        results, outcomes = await first_k(
            [call.generate(m, m.persona(messages) if layer == 0 else with_references(m.persona(messages), answers,
                                                                                     prompt),
                           persona=False, n=1, logprobs=False, top_logprobs=0, constraint=None)
             for m in self.members], self.params.quorum, self.params.grace_s)
        if self.params.quorum is not None:
            got = {status: [m.label for m, o in zip(self.members, outcomes) if o.status == status]
                   for status in ("replied", "failed", "late")}
            seconds = {m.label: round(o.seconds, 3) for m, o in zip(self.members, outcomes)}
            call.trace.setdefault("quorum", {"k": self.params.quorum, "of": len(self.members),
                                             "grace_s": self.params.grace_s, "layers": []})
            call.trace["quorum"]["layers"].append({**got, "seconds": seconds})
        return call.survivors(results, self.members)

    def order(self, call: Call, n: int) -> list[int]:
        """The proposals' order in the judge's prompt: as the members, or (``shuffle``) seeded by the request's
        seed, else by the question (the same question, the same order)."""
        idx = list(range(n))
        if self.params.shuffle:
            seed = call.sampling({}).seed
            key = str(seed) if seed is not None else call.prompt.question
            random.Random(hashlib.sha256(key.encode()).digest()).shuffle(idx)
        return idx

    async def agreement(self, call: Call, alive: list[tuple[Member, Generation]]) -> dict[str, Any]:
        """Do the proposals agree? (the judge-skip test, with the reasons it may not apply)."""
        kind, rule = answer_kind(call.prompt.question, self.params.answer)
        extracted = [extract_answer(g.choices[0].text, kind) for _, g in alive]
        canon = await AnswerCanon(kind, self.params.text_threshold).canon(extracted)
        out: dict[str, Any] = {"answer_type": kind, "answer_rule": rule,
                               "answers": {m.label: a for (m, _), a in zip(alive, extracted)}}
        if len(alive) < 2:
            out["agree"], out["why_not"] = False, "fewer than two proposals"
        elif not all(canon) or len(set(canon)) > 1:
            out["agree"], out["why_not"] = False, "the proposals' answers differ"
        elif call.sampling({}).constraint is not None or call.logprobs:
            out["agree"], out["why_not"] = True, ("a response format or logprobs apply to the aggregate only: "
                                                  "the judge writes it")
        else:
            out["agree"], out["skipped"] = True, True
        return out

    async def stream(self, call: Call) -> AsyncGenerator[Delta, None]:
        messages = call.prompt.as_messages()
        layers: list[list[dict[str, Any]]] = []
        call.trace["layers"] = layers
        answers: list[str] = []
        alive: list[tuple[Member, Generation]] = []
        for layer in range(self.params.layers):
            if layer and call.over_budget(f"layer {layer}"):
                break
            with spans.step("moa.layer", call.scope, chorus__layer=layer):
                alive = await self.propose(call, layer, messages, answers)
            answers = [g.choices[0].text for _, g in alive]
            layers.append([{"member": m.label, "text": g.choices[0].text} for m, g in alive])
        judge: dict[str, Any] = {"model": self.aggregator.spec.model, "label": self.aggregator.label}
        call.trace["judge"] = judge
        if call.over_budget("the judge"):  # the first proposal of the last layer answers
            m, g = alive[0]
            judge["skipped"] = True
            call.trace.update({"winner": {"member": m.label}, "reason": f"{call.stopped}: the first proposal"})
            yield Delta(0, g.choices[0].text, finish_reason=g.choices[0].finish_reason)
            return
        if self.params.skip_judge:
            judge.update(await self.agreement(call, alive))
            if judge.get("skipped"):
                m, g = alive[0]
                call.trace["winner"] = {"member": m.label}
                call.trace["reason"] = (f"judge skipped: the {len(alive)} proposals agree on "
                                        f"{judge['answers'][m.label]!r}; the first of them is the reply")
                yield Delta(0, g.choices[0].text, finish_reason=g.choices[0].finish_reason)
                return
        order = self.order(call, len(answers))
        judge["order"] = [alive[i][0].label for i in order]  # answer k in the judge's prompt is order[k-1]
        shown = [answers[i] for i in order]
        after = ""
        span = spans.started("moa.judge", call.scope, chorus__member=self.aggregator.label,
                             chorus__proposals=len(shown))
        try:  # the judge's calls (its rationale, its answer) are the span's children
            if self.params.rationale:
                with spans.within(span):
                    gen = await call.generate(self.aggregator, with_references(self.aggregator.persona(messages),
                                                                               shown, ASSESS),
                                              persona=False, n=1, logprobs=False, top_logprobs=0, constraint=None)
                judge["rationale"] = gen.choices[0].text if gen is not None else None
                if judge["rationale"]:
                    after = ASSESSMENT + judge["rationale"]
            final = with_references(self.aggregator.persona(messages), shown, self.params.aggregate_prompt, after)
            async for d in spans.under(span, call.stream(self.aggregator, final, persona=False)):
                yield d
        finally:
            span.end()
        call.trace["winner"] = {"member": self.aggregator.label}
        call.trace["reason"] = f"aggregator synthesised {len(answers)} proposals from {self.params.layers} layer(s)"
