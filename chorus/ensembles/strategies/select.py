"""``select``: a learned selector over multiple-choice answers (``POST /v1/choices``).

Every member scores the choices (all three normalisations, whatever the request shows); the selector's
logistic regression, trained by ``chorus train selector`` on labelled items (chorus/training/selector.py),
reads features of the members' answers and gives one distribution over the choices. Where its
cross-validated gain over the best single member did not exclude zero, the artifact falls back to that member:
the ensemble asks only that member and answers with its distribution (the trace says so).

``artifact`` names a trained selector in ``$CHORUS_HOME/selectors/`` (a name, or a path inside that folder:
a request cannot make the server read files elsewhere). Its members must be the ensemble's members, in order.
The strategy generates nothing: chat and completions with it are a 400.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from pydantic import BaseModel, ConfigDict, Field

from chorus.engines.core.base import Delta
from chorus.ensembles.base import Strategy
from chorus.ensembles.call import Call, Member, gather, with_own_sampling
from chorus.ensembles.choice_scores import ChoiceAnswer, ChoiceQuestion
from chorus.ensembles.fitted.artifact import load_trained
from chorus.ensembles.fitted.selector import NORMS, Selector
from chorus.ensembles.metrics import SELECTOR_CHOICES
from chorus.errors import InvalidRequest


class SelectParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    artifact: str = Field(min_length=1, description="a trained selector's name (or path) in $CHORUS_HOME/selectors")


def load_selector(name: str, members: list[str]) -> Selector:
    selector = load_trained(Selector, name, members, "selector")
    return selector


class Select(Strategy):
    requires = frozenset()  # language models or scorers: anything that scores choices
    Params = SelectParams
    scores_only = True

    @classmethod
    def check_config(cls, params: SelectParams, members: list[str]) -> None:
        load_selector(params.artifact, members)

    def check(self) -> None:
        self.selector = load_selector(self.params.artifact, [m.spec.model for m in self.members])
        own = with_own_sampling(self.members)
        if own:
            raise InvalidRequest("select samples nothing: per-member temperature / top_p / seed do not apply "
                                 f"(members: {', '.join(own)}).", param="ensemble.members")

    async def score_choices(self, call: Call, question: ChoiceQuestion, combine: str | None) -> ChoiceAnswer:
        if combine not in (None, "probabilities"):
            raise InvalidRequest("combine is not available for the 'select' strategy: the selector chooses from "
                                 "the members' distributions over the choices.", param="combine")
        if question.text is None:
            raise InvalidRequest("The 'select' strategy reads a text 'prompt' (the selector was trained on text "
                                 "prompts), not chat 'messages'.", param="messages")
        other = [n for n in question.normalisations if n not in NORMS]
        if other:
            raise InvalidRequest(f"The 'select' strategy gives one distribution over the choices for the "
                                 f"normalisations {', '.join(NORMS)}; not {', '.join(other)}.", param="normalisations")
        full = ChoiceQuestion(question.choices, list(NORMS), text=question.text)

        async def one(m: Member) -> ChoiceAnswer:
            answer, tokens = await full.answer(m.engine)
            call.record(m, tokens, 0)
            return answer

        fallback = self.selector.fallback
        if fallback is not None:  # the fallback member's answer is the answer: the others are not asked
            (m,) = [m for m in self.members if m.spec.model == fallback][:1]
            answer = await one(m)
            SELECTOR_CHOICES.labels(self.ensemble, m.label).inc()
            trace = {"selector": self.params.artifact, "fallback": fallback,
                     "fallback_reason": self.selector.training.get("fallback_reason"), "chosen": answer.chosen["sum"],
                     "scores": [{"member": m.label, "chosen": answer.chosen, "probabilities": answer.probabilities}]}
            return ChoiceAnswer({n: answer.probabilities[n] for n in question.normalisations}, trace=trace)
        answers = await gather(*(one(m) for m in self.members))
        probs = self.selector.probabilities([a.probabilities for a in answers], len(question.text))
        chosen = max(range(len(question.choices)), key=lambda c: probs[NORMS[0]][c])
        agreeing = [m.label for m, a in zip(self.members, answers) if a.chosen["sum"] == chosen]
        SELECTOR_CHOICES.labels(self.ensemble, agreeing[0] if agreeing else "none").inc()
        trace = {"selector": self.params.artifact, "fallback": None, "chosen": chosen,
                 "members_agreeing": agreeing,
                 "scores": [{"member": m.label, "chosen": a.chosen, "probabilities": a.probabilities}
                            for m, a in zip(self.members, answers)]}
        return ChoiceAnswer({n: probs[n] for n in question.normalisations}, trace=trace)

    def stream(self, call: Call) -> AsyncGenerator[Delta, None]:  # pragma: no cover - Ensemble.call refuses first
        raise InvalidRequest("select scores choices only (POST /v1/choices).", param="model")
