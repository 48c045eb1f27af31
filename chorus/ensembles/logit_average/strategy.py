"""``logit_average``: token-level ensembles of members' next-token distributions (docs/methods.md §1).

The strategy reads its parameters, then finds its parts in registry.py: the alignment (``align: vocab``,
`LogitAverage`, one shared vocabulary; ``align: topk_union``, `TopkUnion`, across vocabularies) and, with one
vocabulary, the mode (``full``, ``selective``, ``speculative``). Each request gets its own aligned engine, built
from one frozen `Mixing`; the strategy only asks it to stream and to account, whatever it is.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

from opentelemetry.trace import StatusCode

from chorus.engines.core.base import Delta, TokenLogprob
from chorus.engines.core.generation import check_context
from chorus.ensembles import spans
from chorus.ensembles.base import Strategy
from chorus.ensembles.call import Call, with_own_sampling
from chorus.ensembles.choice_scores import ChoiceAnswer, ChoiceQuestion
from chorus.ensembles.logit_average.params import LogitAverageParams
from chorus.ensembles.logit_average.registry import align_class
from chorus.ensembles.logit_average.shared_vocab import LogitAverage
from chorus.errors import InvalidRequest

__all__ = ["LogitAverage", "LogitAverageParams", "LogitAverageStrategy"]


class LogitAverageStrategy(Strategy):
    """``logit_average``: token-level ensemble; streams tokens as they are chosen. Members need full logits,
    or (remote members) top-k logprobs: then the average is over their top-k and the trace says so.
    A member may carry its own ``system`` prompt (a prompt ensemble: each member's session reads its own
    rendered prompt, and they combine token by token as usual)."""

    requires = frozenset()  # LOGITS or TOPK_LOGITS, checked by the engines below
    Params = LogitAverageParams
    token_level = True
    default_on_member_error = "fail"

    def check(self) -> None:
        own = with_own_sampling(self.members)
        if own:
            raise InvalidRequest(
                "logit_average samples once from the combined distribution; per-member temperature / top_p / "
                f"seed are not allowed (members: {', '.join(own)}). Use 'weights' to favour a member.",
                param="ensemble.members")
        self.aligned = align_class(self.params.align)
        self.lead_index()
        self.engine(skip=False)

    @property
    def personas(self) -> bool:
        return any(m.spec.system is not None for m in self.members)

    def lead_index(self) -> int:
        lead = self.params.lead
        if lead is None:
            return 0
        if isinstance(lead, int):
            if not 0 <= lead < len(self.members):
                raise InvalidRequest(f"'lead' {lead} is not a member index (0..{len(self.members) - 1}).",
                                     param="ensemble.lead")
            return lead
        for m in self.members:
            if m.label == lead:
                return m.index
        raise InvalidRequest(f"'lead' {lead!r} is not a member; members: {', '.join(m.label for m in self.members)}.",
                             param="ensemble.lead")

    def engine(self, skip: bool, on_drop: Callable[[str, str], None] | None = None,
               prompts: list[list[int]] | None = None, per_token: bool = True) -> Any:
        """This request's aligned engine (`LogitAverage` or `TopkUnion`), from one frozen `Mixing`."""
        return self.aligned.for_members(self.members, self.params, self.lead_index(), self.personas, skip,
                                        on_drop, prompts, per_token)

    async def prompt_logprobs(self, call: Call, k: int) -> tuple[list[str], list[TokenLogprob | None]]:
        """The mixture's logprob of each prompt token (shared vocabulary: every member steps the same ids)."""
        if not self.aligned.scores_tokens:
            return await super().prompt_logprobs(call, k)
        if self.personas:
            raise InvalidRequest("members with their own system prompts read different prompts: there is no one "
                                 "prompt to score ('echo' with 'logprobs').", param="echo")
        req = call.request(self.members[0])
        engine: LogitAverage = self.engine(skip=False)
        lps = await engine.prompt_logprobs(req.prompt_ids, k, call.scope)
        for m in self.members:
            call.record(m, len(req.prompt_ids), 0)
        return [engine.tokenizer.decode([t]) for t in req.prompt_ids], lps

    async def score_choices(self, call: Call, question: ChoiceQuestion, combine: str | None) -> ChoiceAnswer:
        """One vocabulary: by default per token (the mixture's logprob of each choice token, from one shared
        tokenization), then normalised like one model's; ``combine: probabilities`` averages the members'
        distributions over the choices instead (always, with ``align: topk_union``, and with members that carry
        their own system prompts: each scores under its own prompt)."""
        if not self.aligned.scores_tokens or combine == "probabilities" or self.personas:
            if combine == "tokens":
                why = "members with their own system prompts" if self.personas else self.params.align
                raise InvalidRequest(f"combine 'tokens' needs one shared prompt and vocabulary; with {why} use "
                                     "'probabilities'.", param="combine")
            return await super().score_choices(call, question, "probabilities")
        engine: LogitAverage = self.engine(skip=False)
        scores = await question.score(engine, scope=call.scope)
        for m in self.members:
            call.record(m, scores.tokens_scored, 0)
        answer = ChoiceAnswer.of(scores, question.normalisations)
        answer.trace = {"combine": "tokens", "weights": engine.weights.tolist(), "space": self.params.space}
        return answer

    def precheck(self, call: Call) -> None:
        limit = min(m.engine.max_model_len for m in self.members)
        for m in self.members if self.personas else self.members[:1]:
            req = call.request(m)
            check_context(len(req.prompt_ids), req.params, limit)

    async def stream(self, call: Call) -> AsyncGenerator[Delta, None]:
        dropped: list[str] = []

        def on_drop(label: str, error: str) -> None:
            dropped.append(label)
            call.trace.setdefault("errors", []).append({"member": label, "error": error})

        own = self.personas or self.aligned.own_prompts  # each member renders its own prompt
        reqs = [call.request(m) for m in self.members] if own else [call.request(self.members[0])] * len(self.members)
        prompts = [r.prompt_ids for r in reqs] if self.personas else None
        engine = self.engine(call.on_member_error == "skip", on_drop, prompts, per_token=call.detail)
        call.trace.update({"weights": engine.weights.tolist(), "space": self.params.space,
                           "align": self.params.align})
        deltas = engine.stream_for(reqs, call)
        emitted: list[int] = []
        # token by token, every member is at work for the whole answer: one span each, from start to end
        member_spans = [spans.member_call(call.scope, call.ensemble, m.label, m.spec.model, r.params.max_tokens,
                                          r.params.temperature) for m, r in zip(self.members, reqs)]
        try:
            async for d in deltas:
                if d.index == 0:
                    emitted.extend(d.token_ids)
                yield d
        finally:
            await deltas.aclose()
            engine.finish(call, self.members, reqs, dropped, emitted)
            for m, r, span in zip(self.members, reqs, member_spans):
                if m.label in dropped:
                    span.set_status(StatusCode.ERROR, "dropped")
                spans.usage(span, len(r.prompt_ids), len(emitted))
                span.end()
