"""``cascade``: ask members cheap to expensive; accept the first answer confident enough (FrugalGPT-style).

Confidence of an answer:
- ``mean_logprob``: mean log-probability of its tokens (threshold in (-inf, 0]);
- ``min_logprob``: its least likely token's log-probability (threshold in (-inf, 0]);
- ``agreement`` (the agreement cascade): ``samples`` answers are drawn in one request; the share that give the
  most common extracted answer (``answer``: number, choice, yes_no, text or auto, as `answer_vote` extracts
  them; a sample without an answer counts against agreement). The reply is the majority answer's most likely
  sample (whole text).
The last member's answer is always accepted. ``threshold`` is one number or one per step (members
minus one), or comes from ``artifact``: by name, what `chorus train cascade` wrote in ``$CHORUS_HOME/selectors``
(thresholds fitted on a train split for a target accuracy), whose members must be this ensemble's, in order. The
accepted answer streams once accepted; the trace lists every step's confidence and why it escalated or stopped.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from chorus.engines.core.base import Choice, Delta
from chorus.ensembles import spans
from chorus.ensembles.answers.kinds import answer_kind
from chorus.ensembles.answers.votes import Sample, Unfinished, agreement, ranked_samples, tally
from chorus.ensembles.base import Strategy
from chorus.ensembles.call import Call
from chorus.ensembles.drawing import Drawer, DrawParams
from chorus.ensembles.fitted.artifact import load_trained
from chorus.ensembles.fitted.cascade import CascadeThresholds
from chorus.ensembles.metrics import CASCADE_STEPS
from chorus.errors import InvalidRequest


class CascadeParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    confidence: Literal["mean_logprob", "min_logprob", "agreement"] = "mean_logprob"
    threshold: float | list[float] | None = Field(
        default=None, description="accept when confidence >= threshold (one, or one per step)")
    artifact: str | None = Field(default=None, description=(
        "agreement: thresholds from `chorus train cascade`, by name in $CHORUS_HOME/selectors"))
    samples: int = Field(default=3, ge=2, le=16, description="agreement: answers drawn per member")
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, description="agreement: sampling temperature")
    answer: Literal["number", "choice", "yes_no", "text", "auto"] = Field(
        default="text", description="agreement: what must agree")
    unfinished: Unfinished = Field(default="abstain", description=(
        "agreement: samples cut at max_tokens abstain (unless none finished) or vote"))


def fitted_thresholds(name: str, members: list[str], unfinished: Unfinished = "abstain") -> list[float]:
    """The thresholds of a `chorus train cascade` artifact by name in ``$CHORUS_HOME/selectors`` (never a path
    elsewhere), fitted for the ensemble's members (models, in order): a 400 naming ``ensemble.artifact`` when it is
    missing or cannot be read, ``ensemble.members`` when fitted for other members, and ``ensemble.unfinished``
    when fitted with the other rule for cut samples."""
    fitted = load_trained(CascadeThresholds, name, members, "cascade", command="chorus train cascade")
    if fitted.unfinished != unfinished:
        raise InvalidRequest(f"the cascade artifact {name!r} was fitted with unfinished: {fitted.unfinished}; the "
                             f"ensemble has unfinished: {unfinished} (set the same, or fit again).",
                             param="ensemble.unfinished")
    return [float(x) for x in fitted.thresholds]


def agreed_choice(samples: list[Sample], unfinished: Unfinished = "abstain") -> tuple[float, Choice] | None:
    """Agreement and the majority answer's most likely sample, as a choice; None when nothing was drawn."""
    if not samples:
        return None
    t = tally(samples, unfinished=unfinished)
    best = ranked_samples(samples, t)[0]  # the majority's likeliest sample (the likeliest, when none answered)
    return agreement(samples, t)[0], Choice(0, best.text, [], best.finish_reason)


class Cascade(Strategy):
    Params = CascadeParams

    def check(self) -> None:
        p: CascadeParams = self.params
        steps = len(self.members) - 1
        if (p.threshold is None) == (p.artifact is None):
            raise InvalidRequest("A cascade needs exactly one of 'threshold' and 'artifact'.",
                                 param="ensemble.threshold")
        if p.artifact is not None:
            if p.confidence != "agreement":
                raise InvalidRequest("'artifact' holds agreement thresholds: it needs confidence: agreement.",
                                     param="ensemble.artifact")
            t = fitted_thresholds(p.artifact, [m.spec.model for m in self.members], p.unfinished)
        else:
            assert p.threshold is not None
            t = p.threshold if isinstance(p.threshold, list) else [p.threshold] * steps
        if len(t) != steps:
            raise InvalidRequest(f"'threshold' must be one number or {steps} (one per member but the last).",
                                 param="ensemble.threshold")
        if p.confidence == "agreement" and any(not 0 < x <= 1 for x in t):
            raise InvalidRequest("agreement thresholds are shares: each must be in (0, 1].", param="ensemble.threshold")
        if p.confidence != "agreement" and any(x > 0 for x in t):
            raise InvalidRequest("log-probability thresholds must be <= 0 (e.g. -0.5).", param="ensemble.threshold")
        self.thresholds = t

    def confidence(self, choices: list[Choice]) -> tuple[float, Choice]:
        lps = [lp.logprob for lp in choices[0].logprobs or []]
        if not lps:
            return float("-inf"), choices[0]
        return (sum(lps) / len(lps) if self.params.confidence == "mean_logprob" else min(lps)), choices[0]

    async def stream(self, call: Call) -> AsyncGenerator[Delta, None]:
        p: CascadeParams = self.params
        steps: list[dict[str, object]] = []
        call.trace.update({"confidence": p.confidence, "thresholds": self.thresholds, "steps": steps})
        kind = answer_kind(call.prompt.question, p.answer)
        drawer = Drawer(call, DrawParams(answer=p.answer, samples=p.samples, batch=p.samples, text_threshold=None,
                                         temperature=p.temperature), kind)
        last = len(self.members) - 1
        best: tuple[float, Choice, str] | None = None  # if the later members fail, the most confident answer
        for i, m in enumerate(self.members):
            if best is not None and call.over_budget(f"asking {m.label}"):
                break  # the most confident answer so far
            with spans.step("cascade.step", call.scope, chorus__step=i, chorus__member=m.label):
                if p.confidence == "agreement":
                    drawn = await drawer.draw(m, p.samples)
                    found = agreed_choice(drawn, p.unfinished)
                else:
                    gen = await call.generate(m, logprobs=True, top_logprobs=0, n=1)
                    found = None if gen is None else self.confidence(gen.choices)
            if found is None:  # skipped: escalate
                steps.append({"member": m.label, "error": True, "decision": "failed: escalate"})
                CASCADE_STEPS.labels(self.ensemble, m.label, "failed").inc()
                continue
            conf, chosen = found
            if best is None or conf > best[0]:
                best = (conf, chosen, m.label)
            if i == last:
                decision = "accepted: last member"
            elif conf >= self.thresholds[i]:
                decision = f"accepted: confidence {conf:.4f} >= {self.thresholds[i]}"
            else:
                steps.append({"member": m.label, "confidence": conf, "threshold": self.thresholds[i],
                              "decision": f"escalated: confidence {conf:.4f} < {self.thresholds[i]}",
                              "text": chosen.text})
                CASCADE_STEPS.labels(self.ensemble, m.label, "escalated").inc()
                continue
            steps.append({"member": m.label, "confidence": conf, "decision": decision})
            CASCADE_STEPS.labels(self.ensemble, m.label, "accepted").inc()
            call.trace.update({"winner": {"member": m.label}, "reason": decision})
            yield Delta(0, chosen.text, finish_reason=chosen.finish_reason)
            return
        if best is None:
            call.survivors([], self.members)  # every member failed: raises with the errors
            return
        conf, chosen, label = best
        why = call.stopped if call.stopped is not None else "the later members failed"
        reason = f"accepted: {why}; {label} was the most confident ({conf:.4f})"
        call.trace.update({"winner": {"member": label}, "reason": reason})
        yield Delta(0, chosen.text, finish_reason=chosen.finish_reason)
