"""Shared-vocabulary logit averaging (docs/methods.md §1).

One session (own KV cache) per member per request. Each step combines the members' next-token
distributions with normalised weights, in probability space (``p = sum_i w_i softmax(z_i)``, the
default) or logit space (``z = sum_i w_i z_i``); the decode loop's sampling then acts on the combined
distribution, and the chosen token is fed to every member. Because members' sessions live in their
engines' batch runners, concurrent ensemble requests batch like single-model ones.

`LogitAverage` is itself an engine (a `SessionEngine`), so generation, streaming, stop strings, n,
seeds and logprobs work exactly as for one model; `LogitAverageStrategy` serves it as the
``logit_average`` strategy (``align: topk_union`` switches to `ensembles.topk_union` for members with
different vocabularies).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from chorus.engines.base import LOGITS, TOPK_LOGITS, Delta, Engine, Session, TokenLogprob
from chorus.engines.generation import SessionEngine, check_context
from chorus.engines.scoring import mixture_logprob
from chorus.ensembles.base import Call, Strategy, gather
from chorus.ensembles.choice_scores import ChoiceAnswer, ChoiceQuestion
from chorus.ensembles.stepping import normalised_weights, step_members
from chorus.ensembles.topk_union import TopkUnion
from chorus.errors import CapabilityMismatch, InvalidRequest

SPACES = ("probability", "logit")


class AveragedSession:
    """One sequence of the ensemble: one session per member, stepped together.

    A member that fails raises `MemberFailed` naming it, or (``skip``) is dropped and the remaining
    weights renormalised; ``on_drop(label, error)`` reports it.
    """

    def __init__(self, members: list[Session], weights: torch.Tensor, space: str, vocab: int,
                 labels: list[str], skip: bool = False,
                 on_close: Callable[[AveragedSession], None] | None = None,
                 on_drop: Callable[[str, str], None] | None = None) -> None:
        self.members = members
        self.weights = weights  # (M,)
        self.space = space
        self.vocab = vocab
        self.labels = labels
        self.skip = skip
        self._on_close = on_close
        self._on_drop = on_drop

    @property
    def length(self) -> int:
        return self.members[0].length

    def combine(self, logits: Sequence[torch.Tensor]) -> torch.Tensor:
        z = torch.stack([x[: self.vocab].float() for x in logits])  # (M, V)
        if self.space == "logit":
            return (self.weights[:, None] * z).sum(0)
        p = (self.weights[:, None] * torch.softmax(z, dim=-1)).sum(0)  # (V,)
        return torch.log(p.clamp_min(1e-30))  # log-probabilities: sampling acts on p itself

    async def _all(self, calls: list[Awaitable[torch.Tensor]]) -> torch.Tensor:
        keep, results = await step_members(calls, self.labels, self.skip, self._on_drop)
        if len(keep) < len(self.members):
            for i in set(range(len(self.members))) - set(keep):
                self.members[i].close()
            self.members = [self.members[i] for i in keep]
            self.labels = [self.labels[i] for i in keep]
            w = self.weights[keep]
            self.weights = w / w.sum() if w.sum() > 0 else torch.full_like(w, 1 / len(keep))
        return self.combine(results)

    async def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        return await self._all([m.prefill(ids) for m in self.members])

    async def step(self, token: int) -> torch.Tensor:
        return await self._all([m.step(token) for m in self.members])

    def close(self) -> None:
        for m in self.members:
            m.close()
        if self._on_close is not None:
            self._on_close(self)


class LogitAverage(SessionEngine):
    requires = frozenset({LOGITS})

    def __init__(self, members: list[Engine], weights: Sequence[float] | None = None,
                 space: str = "probability", name: str = "logit_average", labels: list[str] | None = None,
                 skip: bool = False, on_drop: Callable[[str, str], None] | None = None) -> None:
        if len(members) < 2:
            raise InvalidRequest("logit_average needs at least 2 members.", param="ensemble.members")
        self.labels = labels or [m.name for m in members]
        lacking = [lb for lb, m in zip(self.labels, members) if not {LOGITS, TOPK_LOGITS} & m.capabilities]
        if lacking:
            raise CapabilityMismatch(f"logit_average needs members with next-token logits (in-process) or top-k "
                                     f"logprobs (remote, api: completions); these have neither: "
                                     f"{', '.join(lacking)}.", param="ensemble.members")
        self.approximate = [lb for lb, m in zip(self.labels, members) if LOGITS not in m.capabilities]
        if self.approximate and space == "logit":
            raise InvalidRequest(f"space 'logit' needs full logits; {', '.join(self.approximate)} give only top-k "
                                 "logprobs. Use space 'probability'.", param="ensemble.space")
        base = members[0].tokenizer.fingerprint
        differ = [lb for lb, m in zip(self.labels, members) if m.tokenizer.fingerprint != base]
        if differ:
            raise CapabilityMismatch(
                f"logit_average needs members that share one vocabulary; {', '.join(differ)} differ from "
                f"{self.labels[0]}. Use \"align\": \"topk_union\" to ensemble different vocabularies.",
                param="ensemble.members")
        if space not in SPACES:
            raise InvalidRequest(f"'space' must be one of {', '.join(SPACES)}.", param="ensemble.space")
        self.name = name
        self.members = members
        self.weights = normalised_weights(weights, len(members))
        self.space = space
        self.skip = skip
        self.on_drop = on_drop
        self.tokenizer = members[0].tokenizer
        self.sampling_defaults = dict(members[0].sampling_defaults)
        self.max_model_len = min(m.max_model_len for m in members)
        self.vocab = self.tokenizer.vocab_size
        self._open: set[AveragedSession] = set()

    def open_session(self) -> AveragedSession:
        sessions: list[Session] = []
        try:
            for m in self.members:
                sessions.append(m.open_session())
        except BaseException:
            for s in sessions:
                s.close()
            raise
        session = AveragedSession(sessions, self.weights, self.space, self.vocab, list(self.labels), self.skip,
                                  on_close=self._open.discard, on_drop=self.on_drop)
        self._open.add(session)
        return session

    @property
    def active_sessions(self) -> int:
        return len(self._open)

    async def score_continuations(self, prefix: list[int], continuations: list[list[int]]) -> list[list[float]]:
        """Probability space: each member scores the continuations its own (fastest) way and each token's
        mixture logprob is ``log sum_i w_i p_i(token)``, which needs only the members' logprobs of that
        token. Logit space needs whole distributions: the generic way, stepping averaged sessions."""
        if self.space == "logit":
            return await super().score_continuations(prefix, continuations)
        weights = self.weights.tolist()
        scored = await gather(*(m.score_continuations(prefix, continuations) for m in self.members))
        return [mixture_logprob([member[i] for member in scored], weights) for i in range(len(continuations))]


class LogitAverageParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weights: list[float] | None = Field(default=None, description="one per member; normalised; default equal")
    space: Literal["probability", "logit"] = "probability"
    align: Literal["vocab", "topk_union"] = Field(
        default="vocab", description="vocab: members share one vocabulary; topk_union: UniTE over token strings")
    top_k: int = Field(default=10, ge=1, le=100, description="topk_union: tokens each member proposes per step")


class LogitAverageStrategy(Strategy):
    """``logit_average``: token-level ensemble; streams tokens as they are chosen. Members need full logits,
    or (remote members) top-k logprobs: then the average is over their top-k and the trace says so."""

    requires = frozenset()  # LOGITS or TOPK_LOGITS, checked by the engines below
    Params = LogitAverageParams
    token_level = True
    default_on_member_error = "fail"

    def check(self) -> None:
        own = [m.label for m in self.members
               if m.spec.system is not None or m.spec.temperature is not None or m.spec.top_p is not None
               or m.spec.seed is not None]
        if own:
            raise InvalidRequest(
                "logit_average feeds one prompt to every member and samples once from the combined "
                f"distribution; per-member system / temperature / top_p / seed are not allowed (members: "
                f"{', '.join(own)}). Use 'weights' to favour a member.", param="ensemble.members")
        self.engine(skip=False)

    def engine(self, skip: bool, on_drop: Callable[[str, str], None] | None = None) -> LogitAverage | TopkUnion:
        engines = [m.engine for m in self.members]
        labels = [m.label for m in self.members]
        p = self.params
        if p.align == "topk_union":
            return TopkUnion(engines, p.weights, p.top_k, labels=labels, skip=skip, on_drop=on_drop)
        return LogitAverage(engines, p.weights, p.space, labels=labels, skip=skip, on_drop=on_drop)

    async def prompt_logprobs(self, call: Call, k: int) -> tuple[list[str], list[TokenLogprob | None]]:
        """The mixture's logprob of each prompt token (shared vocabulary: every member steps the same ids)."""
        if self.params.align == "topk_union":
            return await super().prompt_logprobs(call, k)
        req = call.request(self.members[0])
        engine = self.engine(skip=False)
        assert isinstance(engine, LogitAverage)
        lps = await engine.prompt_logprobs(req.prompt_ids, k)
        for m in self.members:
            call.record(m, len(req.prompt_ids), 0)
        return [engine.tokenizer.decode([t]) for t in req.prompt_ids], lps

    async def score_choices(self, call: Call, question: ChoiceQuestion, combine: str | None) -> ChoiceAnswer:
        """One vocabulary: by default per token (the mixture's logprob of each choice token, from one shared
        tokenization), then normalised like one model's; ``combine: probabilities`` averages the members'
        distributions over the choices instead (always, with ``align: topk_union``)."""
        if self.params.align == "topk_union" or combine == "probabilities":
            if combine == "tokens":
                raise InvalidRequest("combine 'tokens' needs members that share one vocabulary (align: vocab); "
                                     "with topk_union use 'probabilities'.", param="combine")
            return await super().score_choices(call, question, "probabilities")
        engine = self.engine(skip=False)
        assert isinstance(engine, LogitAverage)
        scores = await question.score(engine)
        for m in self.members:
            call.record(m, scores.tokens_scored, 0)
        answer = ChoiceAnswer.of(scores, question.normalisations)
        answer.trace = {"combine": "tokens", "weights": engine.weights.tolist(), "space": self.params.space}
        return answer

    def precheck(self, call: Call) -> None:
        req = call.request(self.members[0])
        check_context(len(req.prompt_ids), req.params, min(m.engine.max_model_len for m in self.members))

    async def stream(self, call: Call) -> AsyncGenerator[Delta, None]:
        dropped: list[str] = []

        def on_drop(label: str, error: str) -> None:
            dropped.append(label)
            call.trace.setdefault("errors", []).append({"member": label, "error": error})

        engine = self.engine(call.on_member_error == "skip", on_drop)
        call.trace.update({"weights": engine.weights.tolist(), "space": self.params.space,
                           "align": self.params.align})
        if isinstance(engine, TopkUnion):
            call.trace["note"] = ("top-k union over token strings (UniTE): an approximation of the members' full "
                                  "distributions")
            reqs = [call.request(m) for m in self.members]
            deltas = engine.stream_requests(reqs)
        else:
            if engine.approximate:
                call.trace["note"] = (f"approximate: {', '.join(engine.approximate)} served remotely give only their "
                                      "top-k logprobs; other tokens count as probability 0 for them")
            reqs = [call.request(self.members[0])] * len(self.members)
            deltas = engine.stream(reqs[0])
        produced = 0
        try:
            async for d in deltas:
                produced += len(d.token_ids)
                yield d
        finally:
            await deltas.aclose()
            fed = engine.fed if isinstance(engine, TopkUnion) else None
            for i, m in enumerate(self.members):
                if m.label not in dropped:
                    call.record(m, len(reqs[i].prompt_ids), fed[i] if fed is not None else produced)
