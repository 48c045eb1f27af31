"""``answer_vote``: self-consistency over every member's samples: vote on the extracted answers, not the text.

Each member draws ``samples`` replies at ``temperature`` in batches of ``batch`` (one request of ``n`` = batch per
member and batch, so a batch's samples decode together); after each batch the answers are extracted (``answer``:
number, choice, yes_no, text, or auto by `answers.kinds.detect_kind`'s rules; drawn by `drawing.Drawer`), and the
stopping rule (``stop``: none, majority, beta or agree, `answers.votes.settled`) decides whether to draw more. The winner is the answer with
the most votes (``weights``: a member's samples count its weight, scaled so the weights average 1), ties to
the higher mean token log-probability, then to the answer seen first; the reply is the whole text of the
winning answer's most likely sample, so the user sees its reasoning. With ``n`` > 1 the choices are the best
sample of each answer in vote order, then the other samples.

With ``greedy``, each member's greedy answer (one request at temperature 0, beside the first batch) votes too, as
one more sample, seen first. One member with ``samples: k`` is the classic self-consistency of one model (Wang
et al. 2023); several members vote together. The trace lists every sample (member, extracted and canonical answer, mean log-probability,
tokens), the histogram, how many samples were drawn and why sampling stopped.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import AsyncGenerator
from typing import Any, Literal

from pydantic import Field

from chorus.engines.core.base import Delta
from chorus.ensembles import spans
from chorus.ensembles.answers.decide import Rule, decide, sample_confidence
from chorus.ensembles.answers.kinds import answer_kind
from chorus.ensembles.answers.votes import Tally, ranked_samples, settled, tally
from chorus.ensembles.base import Budget, Strategy
from chorus.ensembles.call import Call, gather
from chorus.ensembles.drawing import Drawer, DrawParams, check_stop
from chorus.ensembles.fitted.artifact import load_trained
from chorus.ensembles.fitted.verifier import Verifier
from chorus.ensembles.spec import member_weights
from chorus.errors import InvalidRequest


class AnswerVoteParams(DrawParams):
    weights: list[float] | None = Field(default=None, description="one per member: its samples' vote weight")
    confidence_by: Literal["none", "mean_logprob", "mean_confidence", "lowest_window", "bottom_10", "tail"] = Field(
        default="none", description="the confidence measure samples are filtered, weighed or picked by (reads the "
        "members' token log-probabilities)")
    keep: float = Field(default=1.0, gt=0.0, le=1.0, description="share of the most confident samples that vote")
    weigh: Literal["none", "confidence", "verifier"] = Field(default="none", description=(
        "each vote counts its sample's confidence, or the verifier's probability that it is right"))
    pick: Literal["vote", "most_confident", "verifier"] = Field(default="vote", description=(
        "the reply's answer: the vote's winner, the most confident sample's, or the verifier's best sample's"))
    window: int = Field(default=64, ge=1, le=8192, description="tokens per window of lowest_window, bottom_10 and trace_stop")
    tail: int = Field(default=64, ge=1, le=8192, description="the last tokens the tail measure reads")
    top_logprobs: int = Field(default=20, ge=1, le=20, description="k of the token confidence (top-k log-probs)")
    verifier: str | None = Field(default=None, description="a verifier trained by `chorus train verifier`")
    greedy: bool = Field(default=False, description=(
        "each member's greedy answer (temperature 0) votes too, as one more sample, first"))
    gate: float | None = Field(default=None, description=(
        "with greedy: the greedy answers are drawn first, alone; when they agree and each one's confidence "
        "(gate_by) is at least this, they are the reply and no sample is drawn"))
    trace_stop: float | None = Field(default=None, description=(
        "DeepConf's online stop: each sample is drawn as a stream of its own and stopped, without a vote, once the "
        "mean token confidence of its last `window` tokens falls below this"))
    gate_by: Literal["mean_logprob", "mean_confidence", "lowest_window", "bottom_10", "tail"] = Field(
        default="mean_logprob", description="the confidence measure the gate reads (window and tail as for "
        "confidence_by)")

    def rule(self) -> Rule:
        return Rule(self.confidence_by, self.keep, self.weigh, self.pick, self.window, self.tail)


def check_rule(p: AnswerVoteParams, models: list[str]) -> Verifier | None:
    """The confidence rule's fields agree (each one set is used), and the verifier, if named, is loaded for these
    models; every problem a 400 naming its field."""
    by = p.confidence_by != "none"
    uses_by = p.keep < 1 or p.weigh == "confidence" or p.pick == "most_confident"
    uses_verifier = p.weigh == "verifier" or p.pick == "verifier"
    if uses_by and not by:
        what = "keep < 1" if p.keep < 1 else f"weigh: {p.weigh}" if p.weigh == "confidence" else f"pick: {p.pick}"
        raise InvalidRequest(f"{what} needs a confidence measure: set confidence_by to one of mean_logprob, "
                             "mean_confidence, lowest_window, bottom_10, tail.", param="ensemble.confidence_by")
    if by and not uses_by:
        raise InvalidRequest(f"confidence_by: {p.confidence_by} is read only by keep < 1, weigh: confidence or pick: "
                             "most_confident; set one of them, or leave confidence_by out.",
                             param="ensemble.confidence_by")
    if uses_verifier and p.verifier is None:
        raise InvalidRequest("weigh: verifier and pick: verifier need a verifier (a name trained by `chorus train "
                             "verifier`).", param="ensemble.verifier")
    if p.verifier is not None and not uses_verifier:
        raise InvalidRequest("a verifier is read only by weigh: verifier or pick: verifier; set one of them, or "
                             "leave verifier out.", param="ensemble.verifier")
    gated = p.gate is not None
    if gated and not p.greedy:
        raise InvalidRequest("gate decides on the greedy answers before any sample: it needs greedy: true.",
                             param="ensemble.gate")
    given = p.model_fields_set
    if "gate_by" in given and not gated:
        raise InvalidRequest("gate_by is read only by the gate; set gate (a confidence threshold), or leave gate_by "
                             "out.", param="ensemble.gate_by")
    measures = {p.confidence_by} | ({p.gate_by} if gated else set())
    watched = p.trace_stop is not None
    unread = [f for f, read in (("window", bool(measures & {"lowest_window", "bottom_10"}) or watched),
                                ("tail", "tail" in measures),
                                ("top_logprobs", by or p.verifier is not None or watched
                                 or (gated and p.gate_by != "mean_logprob")))
              if f in given and not read]
    if unread:
        raise InvalidRequest(f"{unread[0]} is read only by a confidence measure that uses it (window: lowest_window, "
                             "bottom_10; tail: tail; top_logprobs: any, or a verifier); leave it out or set "
                             "confidence_by.", param=f"ensemble.{unread[0]}")
    if p.stop != "none" and not (p.keep == 1 and p.weigh == "none" and p.pick == "vote"):
        raise InvalidRequest(f"stop: {p.stop} counts plain votes between batches; with keep, weigh or pick every "
                             "sample is drawn first (stop: none).", param="ensemble.stop")
    if p.verifier is None:
        return None
    return load_trained(Verifier, p.verifier, models, "verifier", param="ensemble.verifier",
                        command="chorus train verifier")


class AnswerVote(Strategy):
    Params = AnswerVoteParams
    min_members = 1
    answers_n = True

    def check(self) -> None:
        p: AnswerVoteParams = self.params
        check_stop(p)
        w = member_weights(p.weights, len(self.members))
        self.weights = {m.label: x * len(w) for m, x in zip(self.members, w)}  # averaging 1
        self.rule = p.rule()
        self.model_names = list(dict.fromkeys(m.spec.model for m in self.members))
        self.verifier = check_rule(p, self.model_names)
        reads = (p.confidence_by != "none" or (self.verifier is not None and self.verifier.confidence)
                 or (p.gate is not None and p.gate_by != "mean_logprob") or p.trace_stop is not None)
        deaf = [m.label for m in self.members if not getattr(m.engine, "relays_logprobs", True)]
        if (reads or p.gate is not None) and deaf:
            field = ("gate" if p.gate is not None else "trace_stop" if p.trace_stop is not None
                     else "verifier" if p.confidence_by == "none" else "confidence_by")
            raise InvalidRequest(f"confidence reads the samples' token log-probabilities, and member(s) "
                                 f"{', '.join(deaf)} do not relay them.", param=f"ensemble.{field}")
        self.top = p.top_logprobs if reads else 0

    def per_member(self) -> int:
        return self.params.samples + (1 if self.params.greedy else 0)

    def budget(self) -> Budget:
        return Budget(candidates=self.per_member() * len(self.members))

    def precheck(self, call: Call) -> None:
        super().precheck(call)
        if call.n > self.per_member() * len(self.members):
            raise InvalidRequest(f"n={call.n} exceeds the {self.per_member() * len(self.members)} samples this "
                                 "ensemble draws.", param="n")

    async def stream(self, call: Call) -> AsyncGenerator[Delta, None]:
        p: AnswerVoteParams = self.params
        kind = answer_kind(call.prompt.question, p.answer)
        d = Drawer(call, p, kind, self.top, (p.window, p.trace_stop) if p.trace_stop is not None else None)
        alive = list(self.members)
        stopped = ""
        t = Tally()
        first = p.greedy  # the greedy answers are drawn beside the first batch
        if p.gate is not None:  # ... or alone, first: confident and agreeing, they are the reply
            with spans.step("vote.gate", call.scope):
                await gather(*(d.draw(m, 1, greedy=True) for m in alive))
            first = False
            gate = self.gated(d)
            call.trace["gate"] = gate
            if gate["passed"]:
                alive, stopped = [], "the greedy answers agree and are confident: no sample drawn"
                t = tally(d.all(), self.weights, p.unfinished)
        while alive:
            left = {m.label: p.samples - len(d.samples.get(m.label, [])) for m in alive}
            with spans.step("vote.batch", call.scope, chorus__drawn=len(d.all())):
                greedy = [d.draw(m, 1, greedy=True) for m in alive] if first else []
                got = (await gather(*(d.draw(m, min(p.batch, left[m.label])) for m in alive), *greedy))[:len(alive)]
                first = False
            alive = [m for m, new in zip(alive, got) if new and len(d.samples[m.label]) < p.samples]
            t = tally(d.all(), self.weights, p.unfinished)
            remaining = sum(self.weights[m.label] * (p.samples - len(d.samples[m.label])) for m in alive)
            done, stopped = settled(t, remaining, p.stop, p.confidence)
            if done:
                break
            if alive and d.all() and call.over_budget("the next batch"):
                stopped = call.stopped or ""
                break
        if self.rule.plain:
            ranked, answer = ranked_samples(d.all(), t), t.winner
        else:
            models = {m.label: m.spec.model for m in self.members}
            dec = decide(d.all(), self.rule, self.weights, p.unfinished, self.verifier,
                         [models[s.member] for s in d.all()])
            t, ranked, answer = dec.tally, dec.ranked, dec.answer
        if not ranked:
            call.survivors([], self.members)  # every member failed: raises with their errors
        call.trace.update(d.trace(t, stopped))
        if p.trace_stop is not None:
            call.trace["trace_stop"] = {"threshold": p.trace_stop, "window": p.window, "stopped": d.stopped}
        if not self.rule.plain:
            call.trace["confidence"] = {"rule": dataclasses.asdict(self.rule), "by_sample": dec.confidence,
                                        "voted": dec.voted, "verifier": dec.verified}
        call.trace.update({"winner": {"answer": answer, "member": ranked[0].member},
                           "reason": self.reason(t, answer)})
        for delta in call.reply(ranked):
            yield delta

    def gated(self, d: Drawer) -> dict[str, Any]:
        """The gate's decision on the greedy answers drawn: each one's confidence by ``gate_by``; passed when
        every member gave one, they all give the same answer, and each is at least ``gate``."""
        p: AnswerVoteParams = self.params
        gate = p.gate if p.gate is not None else math.inf
        conf = {m.label: sample_confidence(s, p.gate_by, p.window, p.tail) if (s := d.greedy.get(m.label)) else None
                for m in self.members}
        answers = {s.canonical for s in d.greedy.values()}
        passed = (len(d.greedy) == len(self.members) and len(answers) == 1 and "" not in answers
                  and all(c is not None and c >= gate for c in conf.values()))
        return {"by": p.gate_by, "threshold": p.gate, "confidence": conf, "passed": passed}

    def reason(self, t: Tally, answer: str) -> str:
        if not answer:
            return "no sample gave an extractable answer: the most likely sample is returned"
        if self.rule.pick != "vote":
            by = "most confident" if self.rule.pick == "most_confident" else "verifier's best"
            return f"answer {answer!r} is the {by} sample's"
        return (f"answer {answer!r} has {t.counts[answer]:g} of {t.votes} votes"
                + (f" (tie broken by {t.tie_broken_by})" if t.tie_broken_by else ""))
