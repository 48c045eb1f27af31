"""``cascade``: ask members cheap to expensive; accept the first answer confident enough (FrugalGPT-style).

Confidence of an answer:
- ``mean_logprob``: mean log-probability of its tokens (threshold in (-inf, 0]);
- ``min_logprob``: its least likely token's log-probability (threshold in (-inf, 0]);
- ``agreement``: ``samples`` answers are drawn; the share that agree with the most common one
  (answers compared after extraction: ``answer`` number / choice, or the whitespace-normalised text).
The last member's answer is always accepted. ``threshold`` is one number or one per step (members
minus one). The accepted answer streams once accepted; the trace lists every step's confidence and why
it escalated or stopped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncGenerator
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from chorus.clients.answers import extract_answer
from chorus.engines.base import Choice, Delta
from chorus.ensembles.base import Strategy
from chorus.ensembles.call import Call
from chorus.ensembles.metrics import CASCADE_STEPS
from chorus.errors import InvalidRequest


class CascadeParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    confidence: Literal["mean_logprob", "min_logprob", "agreement"] = "mean_logprob"
    threshold: float | list[float] = Field(description="accept when confidence >= threshold (one, or one per step)")
    samples: int = Field(default=3, ge=2, le=16, description="agreement: answers drawn per member")
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, description="agreement: sampling temperature")
    answer: Literal["number", "choice", "text"] = Field(default="text", description="agreement: what must agree")


def normalised(text: str) -> str:
    return " ".join(text.lower().split())


class Cascade(Strategy):
    Params = CascadeParams

    def check(self) -> None:
        p: CascadeParams = self.params
        steps = len(self.members) - 1
        t = p.threshold if isinstance(p.threshold, list) else [p.threshold] * steps
        if len(t) != steps:
            raise InvalidRequest(f"'threshold' must be one number or {steps} (one per member but the last).",
                                 param="ensemble.threshold")
        if p.confidence == "agreement" and any(not 0 < x <= 1 for x in t):
            raise InvalidRequest("agreement thresholds are shares: each must be in (0, 1].", param="ensemble.threshold")
        if p.confidence != "agreement" and any(x > 0 for x in t):
            raise InvalidRequest("log-probability thresholds must be <= 0 (e.g. -0.5).", param="ensemble.threshold")
        self.thresholds = t

    def key(self, text: str) -> str:
        kind = self.params.answer
        return normalised(text) if kind == "text" else extract_answer(text, kind)

    def confidence(self, choices: list[Choice]) -> tuple[float, Choice]:
        p: CascadeParams = self.params
        if p.confidence == "agreement":
            keys = [self.key(c.text) for c in choices]
            top, count = Counter(keys).most_common(1)[0]
            return count / len(keys), choices[keys.index(top)]
        lps = [lp.logprob for lp in choices[0].logprobs or []]
        if not lps:
            return float("-inf"), choices[0]
        return (sum(lps) / len(lps) if p.confidence == "mean_logprob" else min(lps)), choices[0]

    async def stream(self, call: Call) -> AsyncGenerator[Delta, None]:
        p: CascadeParams = self.params
        steps: list[dict[str, object]] = []
        call.trace.update({"confidence": p.confidence, "thresholds": self.thresholds, "steps": steps})
        over = ({"n": p.samples} | ({"temperature": p.temperature} if p.temperature is not None else {})
                if p.confidence == "agreement" else {"logprobs": True, "top_logprobs": 0, "n": 1})
        last = len(self.members) - 1
        best: tuple[float, Choice, str] | None = None  # if the later members fail, the most confident answer
        for i, m in enumerate(self.members):
            gen = await call.generate(m, **over)
            if gen is None:  # skipped: escalate
                steps.append({"member": m.label, "error": True, "decision": "failed: escalate"})
                CASCADE_STEPS.labels(self.ensemble, m.label, "failed").inc()
                continue
            conf, chosen = self.confidence(gen.choices)
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
        reason = f"accepted: the later members failed; {label} was the most confident ({conf:.4f})"
        call.trace.update({"winner": {"member": label}, "reason": reason})
        yield Delta(0, chosen.text, finish_reason=chosen.finish_reason)
