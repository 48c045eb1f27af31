"""Drawing an answer-side strategy's samples, the one place `answer_vote`, `consistency_select` and `cascade`'s
agreement share: what they draw with (`DrawParams`), one request's samples per member and its greedy answers
(`Drawer`: the answers extracted and made canonical as they arrive, the trace of every sample). A strategy's
request passes through once: the strategy reads the answer kind (`answers.kinds.answer_kind`), the drawer draws
through the call (its ``instruction`` is added to the question where the member request is built,
`call.Call.request`), and the call replies with the ranked samples (`call.Call.reply`).

Each ``draw`` is one request of ``n`` = count to a member (so a batch's samples decode together), at the
strategy's ``temperature`` unless the member sets its own, each sample its own seed when the request has one; a
member's greedy answer is one request at temperature 0. With ``top_logprobs`` > 0 every token's top-k
log-probabilities are read, for the samples' confidence (`answers.confidence`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from chorus.ensembles.answers.confidence import Tokens, Watch, token_confidence
from chorus.ensembles.answers.extract import compile_pattern, extract_answer
from chorus.ensembles.answers.kinds import AnswerCanon
from chorus.ensembles.answers.votes import STOP_RULES, Sample, Tally, Unfinished, mean_logprob
from chorus.ensembles.call import Call, Member, gather
from chorus.errors import InvalidRequest, MemberFailed

AnswerKind = Literal["number", "choice", "yes_no", "text", "auto"]
MAX_SAMPLES = 64


class DrawParams(BaseModel):
    """What every answer-side strategy draws with (answer_vote, consistency_select, and cascade's agreement)."""

    model_config = ConfigDict(extra="forbid")

    answer: AnswerKind = "auto"
    samples: int = Field(default=8, ge=1, le=MAX_SAMPLES, description="samples per member (at most)")
    batch: int = Field(default=4, ge=1, le=16, description="samples drawn per member and request (n)")
    temperature: float | None = Field(default=0.7, ge=0.0, le=2.0, description=(
        "unless a member sets its own (null: the request's)"))
    stop: str = Field(default="none", description="adaptive sampling: none, majority, beta or agree")
    confidence: float = Field(default=0.95, gt=0.5, lt=1.0, description="the beta rule's threshold")
    answer_pattern: str | None = Field(default=None, description="regex; its first group is the answer")
    text_threshold: float | None = Field(default=0.85, ge=-1, le=1, description=(
        "text answers: the embedding cosine at or above which two agree (null: normalised text only)"))
    instruction: str | None = Field(default=None, description="appended to the question (default: none)")
    unfinished: Unfinished = Field(default="abstain", description=(
        "samples cut at max_tokens: abstain (vote only when no sample finished) or vote"))

    @field_validator("answer_pattern")
    @classmethod
    def _pattern(cls, v: str | None) -> str | None:
        compile_pattern(v)
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str) -> str:
        if v not in STOP_RULES:
            raise ValueError(f"stop must be one of {', '.join(STOP_RULES)}")
        return v


class Drawer:
    """One request's sampling: the answer kind, the canonical answers, the samples drawn so far per member."""

    def __init__(self, call: Call, p: DrawParams, kind: tuple[str, str], top_logprobs: int = 0,
                 watch: tuple[int, float] | None = None) -> None:
        """``kind``: (the answer kind, the rule that decided it), as `answers.kinds.answer_kind` gives them."""
        self.call = call
        self.p = p
        self.top = top_logprobs  # > 0: read each token's top-k log-probabilities (the samples' confidence)
        #: DeepConf's online stop, (window, threshold): each sample streamed alone and stopped once its last window's
        #: mean token confidence is below the threshold (`confidence.Watch`); a stopped sample does not vote
        self.watch = watch
        self.stopped = 0  # samples the watch stopped
        self.kind, self.rule = kind
        self.canon = AnswerCanon(self.kind, p.text_threshold)
        self.pattern = compile_pattern(p.answer_pattern)
        self.seed = call.sampling({}).seed
        self.samples: dict[str, list[Sample]] = {}
        self.greedy: dict[str, Sample] = {}  # each member's greedy answer, with ``greedy: true``

    async def draw(self, m: Member, count: int, greedy: bool = False) -> list[Sample]:
        """``count`` more samples of member ``m`` (one request of n = count), or its greedy answer; none when the
        member failed (its error is in the trace, or raised with ``on_member_error: fail``)."""
        have = len(self.samples.setdefault(m.label, []))
        # log-probabilities break ties; a member whose engine does not relay them votes without
        # them (its samples tie-break as first seen) rather than failing the request
        over: dict[str, Any] = {"n": count, "logprobs": getattr(m.engine, "relays_logprobs", True),
                                "top_logprobs": self.top}
        if greedy:
            over["temperature"] = 0.0
        elif m.spec.temperature is None and self.p.temperature is not None:
            over["temperature"] = self.p.temperature
        if self.seed is not None and m.spec.seed is None and not greedy:
            over["seed"] = self.seed + 1000 * m.index + have  # every sample its own draw
        if self.watch is not None and not greedy:
            seeds = [over["seed"] + j if "seed" in over else None for j in range(count)]
            got = await gather(*(self.watched(m, {**over, "n": 1, **({"seed": s} if s is not None else {})})
                                 for s in seeds))
            new = [s for s in got if s is not None]
            self.samples[m.label].extend(new)
            return new
        gen = await self.call.generate(m, instruction=self.p.instruction or None, **over)
        if gen is None:
            return []
        answers = [extract_answer(c.text, self.kind, self.pattern) for c in gen.choices]
        canon = await self.canon.canon(answers)
        new = [Sample(m.label, c.text, a, k, mean_logprob([t.logprob for t in c.logprobs or []]),
                      len(c.token_ids), c.finish_reason, per_token=self.per_token(c.logprobs), greedy=greedy)
               for c, a, k in zip(gen.choices, answers, canon)]
        if greedy:
            self.greedy[m.label] = new[0]
        else:
            self.samples[m.label].extend(new)
        return new

    async def watched(self, m: Member, over: dict[str, Any]) -> Sample | None:
        """One sample streamed under the watch: stopped (its stream closed, so the engine stops generating it) once
        its confidence falls, with no answer and ``finish_reason`` "confidence"; None when the member failed."""
        assert self.watch is not None
        watch = Watch(*self.watch)
        text: list[str] = []
        logprobs: list[Any] = []
        tokens, finish, stopped = 0, "stop", False
        stream = self.call.stream(m, instruction=self.p.instruction or None, **over)
        try:
            async for d in stream:
                text.append(d.text)
                logprobs.extend(d.logprobs)
                tokens += len(d.token_ids)
                finish = d.finish_reason or finish
                for t in d.logprobs:
                    stopped = watch.add(token_confidence([x.logprob for x in t.top])) or stopped
                if stopped:
                    break
        except MemberFailed as exc:  # counted by the call's stream; skipped or raised as generate's are
            if self.call.on_member_error == "fail":
                raise
            self.call.trace.setdefault("errors", []).append({"member": m.label, "error": str(exc)})
            return None
        finally:
            await stream.aclose()
        whole = "".join(text)
        answer = canon = ""  # a stopped sample has no answer: it does not vote
        if stopped:
            self.stopped += 1
            finish = "confidence"
        else:
            answer = extract_answer(whole, self.kind, self.pattern)
            canon = (await self.canon.canon([answer]))[0]
        return Sample(m.label, whole, answer, canon, mean_logprob([t.logprob for t in logprobs]), tokens, finish,
                      per_token=self.per_token(logprobs))

    def per_token(self, logprobs: list[Any] | None) -> Tokens | None:
        if not self.top or not logprobs:
            return None
        return Tokens([t.logprob for t in logprobs], [token_confidence([x.logprob for x in t.top]) for t in logprobs])

    def all(self) -> list[Sample]:
        """Every sample: the greedy answers first (a tie goes to the answer seen first), then the samples."""
        return [*self.greedy.values(), *(s for ss in self.samples.values() for s in ss)]

    def trace(self, t: Tally, stopped: str) -> dict[str, Any]:
        return {"answer_type": self.kind, "answer_rule": self.rule, "samples": [
            {"member": s.member, "answer": s.answer, "canonical": s.canonical, "mean_logprob": s.mean_logprob,
             "tokens": s.tokens, "finish_reason": s.finish_reason, "text": s.text,
             **({"greedy": True} if s.greedy else {})} for s in self.all()],
            "histogram": dict(t.ranked()), "drawn": t.drawn, "abstained": t.abstained, "stopped": stopped,
            **({"text_matches": self.canon.how} if self.kind == "text" else {})}


def check_stop(p: DrawParams) -> None:
    if p.stop != "none" and p.samples <= p.batch:
        raise InvalidRequest(f"stop: {p.stop} decides between batches; with samples {p.samples} and batch {p.batch} "
                             "there is only one: it needs more than one batch (samples > batch).",
                             param="ensemble.stop")
