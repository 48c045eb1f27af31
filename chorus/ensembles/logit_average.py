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

from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import replace
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from chorus.engines.core.base import LOGITS, TOPK_LOGITS, Delta, Engine, GenerationRequest, Session, TokenLogprob
from chorus.engines.core.generation import SessionEngine, check_context
from chorus.engines.core.scoring import mixture_logprob
from chorus.ensembles.base import Strategy
from chorus.ensembles.call import Call, gather, with_own_sampling
from chorus.ensembles.choice_scores import ChoiceAnswer, ChoiceQuestion
from chorus.ensembles.metrics import (
    SPECULATIVE_ACCEPTED,
    SPECULATIVE_PROPOSED,
    TOKEN_CATCH_UP,
    TOKEN_CONSULTED,
    TOKEN_POSITIONS,
)
from chorus.ensembles.selective import SelectiveSession
from chorus.ensembles.speculative import SpeculativeSession
from chorus.ensembles.stepping import EnsembleStats, MemberSessions, TokenAgreement, normalised_weights
from chorus.ensembles.topk_union import TopkUnion
from chorus.errors import CapabilityMismatch, InvalidRequest

SPACES = ("probability", "logit")


class AveragedSession(MemberSessions):
    """One sequence of the ensemble (``mode: full``): every member's session stepped together.

    A member that fails raises `MemberFailed` naming it, or (``skip``) is dropped and the remaining
    weights renormalised; ``on_drop(label, error)`` reports it. ``prompts``: each member's own prompt
    (a prompt ensemble: members with their own system messages); otherwise all read the same ids.
    """

    record: TokenAgreement | None = None  # set on the request's first generating session (the trace's tokens)

    @property
    def length(self) -> int:
        return self.members[self.alive[0]].length

    def combine(self, logits: Sequence[torch.Tensor]) -> torch.Tensor:
        """The distributions of the members still in, in order, combined."""
        return self._mix(logits, self.alive)

    async def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        which = list(self.alive)
        kept, results = await self._run([self.members[i].prefill(self._prompt_of(i, ids)) for i in which], which)
        self.stats.positions += 1
        self.stats.consulted += 1
        if self.record is not None:
            self.record.observe(kept, results)
        return self._mix(results, kept)

    async def step(self, token: int) -> torch.Tensor:
        return (await self.extend([token]))[-1]

    async def extend(self, ids: Sequence[int]) -> torch.Tensor:
        which = list(self.alive)
        kept, rows = await self._run([self.members[i].extend(ids) for i in which], which)
        for i in kept:
            self.stats.fed[i] += len(ids)
        self.stats.positions += len(ids)
        self.stats.consulted += len(ids)
        if self.record is not None:
            self.record.fed(ids, [[r[j] for r in rows] for j in range(len(ids))])
        return torch.stack([self._mix([r[j] for r in rows], kept) for j in range(len(ids))])

    def rollback(self, n: int) -> None:
        for i in self.alive:
            self.members[i].rollback(n)
        if self.record is not None:
            self.record.rollback(n)


MODES = ("full", "selective", "speculative")


class LogitAverage(SessionEngine):
    """Members over one vocabulary, combined token by token; itself an engine. ``mode``: ``full`` (every
    member every token), ``selective`` (`SelectiveSession`), ``speculative`` (`SpeculativeSession`).
    ``tally`` sums what this engine's sessions did (an ensemble request builds its own engine)."""

    requires = frozenset({LOGITS})

    def __init__(self, members: list[Engine], weights: Sequence[float] | None = None,
                 space: str = "probability", name: str = "logit_average", labels: list[str] | None = None,
                 skip: bool = False, on_drop: Callable[[str, str], None] | None = None, *, mode: str = "full",
                 lead: int = 0, gate_by: str = "top1", gate: float = 0.5, k: int = 4,
                 temperature: float = 1.0, prompts: list[list[int]] | None = None, per_token: bool = True) -> None:
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
        if mode not in MODES:
            raise InvalidRequest(f"'mode' must be one of {', '.join(MODES)}.", param="ensemble.mode")
        if not 0 <= lead < len(members):
            raise InvalidRequest(f"'lead' must name one of the {len(members)} members.", param="ensemble.lead")
        self.name = name
        self.members = members
        self.weights = normalised_weights(weights, len(members))
        self.space = space
        self.skip = skip
        self.on_drop = on_drop
        self.mode, self.lead, self.gate_by, self.gate, self.k = mode, lead, gate_by, gate, k
        self.temperature = temperature
        self.prompts = prompts
        self.tally = EnsembleStats(self.labels, mode, per_token=per_token)
        self.tokenizer = members[0].tokenizer
        self.sampling_defaults = dict(members[0].sampling_defaults)
        self.max_model_len = min(m.max_model_len for m in members)
        self.vocab = self.tokenizer.vocab_size
        self._open: set[Session] = set()

    def _member_sessions(self) -> list[Session]:
        sessions: list[Session] = []
        try:
            for m in self.members:
                sessions.append(m.open_session())
        except BaseException:
            for s in sessions:
                s.close()
            raise
        return sessions

    def open_session(self) -> Session:
        session = self._open_session(self.mode)
        if isinstance(session, AveragedSession):
            session.record = self.tally.claim()
        return session

    def _open_session(self, mode: str) -> Session:
        sessions = self._member_sessions()
        common: dict[str, Any] = {
            "weights": self.weights, "space": self.space, "vocab": self.vocab, "labels": list(self.labels),
            "stats": self.tally, "temperature": self.temperature, "prompts": self.prompts, "skip": self.skip,
            "on_close": self._open.discard, "on_drop": self.on_drop}
        session: Session
        if mode == "selective":
            session = SelectiveSession(sessions, lead=self.lead, gate_by=self.gate_by, gate=self.gate, **common)
        elif mode == "speculative":
            session = SpeculativeSession(sessions, lead=self.lead, k=self.k, max_len=self.max_model_len,
                                         eos=self.tokenizer.eos_token_ids, **common)
        else:
            session = AveragedSession(sessions, **common)
        self._open.add(session)
        return session

    @property
    def active_sessions(self) -> int:
        return len(self._open)

    def scoring_session(self) -> Session:
        """Scoring reads the full mixture whatever the mode (a selective session would give the lead's)."""
        return self._open_session("full")

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
    mode: Literal["full", "selective", "speculative"] = Field(
        default="full", description="full: every member every token; selective: the lead decodes, the others "
        "are consulted where it is unsure; speculative: the lead drafts k tokens, the others verify them")
    lead: int | str | None = Field(default=None, description="selective / speculative: the member that decodes "
                                   "(its label or index); default the first")
    gate_by: Literal["top1", "entropy"] | None = Field(
        default=None, description="selective: consult when the lead's top-1 probability is below the gate "
        "(top1, the default) or its entropy in nats above it (entropy)")
    gate: float | None = Field(default=None, gt=0.0, description="selective: the threshold (default 0.5 for "
                               "top1, 1.0 for entropy)")
    k: int | None = Field(default=None, ge=1, le=16, description="speculative: tokens drafted per round (default 4)")
    mixture_temperature: float = Field(default=1.0, gt=0.0, le=10.0, description="divides the combined "
                                       "log-probabilities where members are combined (< 1 sharpens)")

    @model_validator(mode="after")
    def _mode_options(self) -> LogitAverageParams:
        for name, modes in OPTION_MODES.items():
            if getattr(self, name) is not None and self.mode not in modes:
                raise ValueError(f"'{name}' applies to mode {' or '.join(modes)}, not {self.mode!r}")
        if self.gate_by != "entropy" and self.gate is not None and self.gate > 1:
            raise ValueError("a top1 gate is a probability: at most 1")
        if self.align == "topk_union" and self.mode != "full":
            raise ValueError(f"mode {self.mode!r} needs one shared vocabulary (align: vocab); topk_union "
                             "ensembles run in mode 'full'")
        if self.align == "vocab" and "top_k" in self.model_fields_set:
            raise ValueError("'top_k' applies to align 'topk_union' (one shared vocabulary averages every token)")
        if self.align == "topk_union" and self.space != "probability":
            raise ValueError("topk_union averages probabilities over the union's strings: space 'logit' needs "
                             "align 'vocab'")
        if self.align == "topk_union" and self.mixture_temperature != 1.0:
            raise ValueError("mixture_temperature applies to align 'vocab'; topk_union mixes over the union's "
                             "strings without it")
        return self


#: the mode-specific options and the modes they apply to (given for another mode: 400, never ignored)
OPTION_MODES = {"gate": ("selective",), "gate_by": ("selective",), "k": ("speculative",),
                "lead": ("selective", "speculative")}


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
        if self.params.align == "topk_union" and self.personas:
            raise InvalidRequest("per-member system prompts need align: vocab (topk_union renders one prompt per "
                                 "member's own template already, from the request's messages).",
                                 param="ensemble.members")
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
               prompts: list[list[int]] | None = None, per_token: bool = True) -> LogitAverage | TopkUnion:
        engines = [m.engine for m in self.members]
        labels = [m.label for m in self.members]
        p = self.params
        if p.align == "topk_union":
            return TopkUnion(engines, p.weights, p.top_k, labels=labels, skip=skip, on_drop=on_drop)
        gate_by = p.gate_by or "top1"
        gate = p.gate if p.gate is not None else (1.0 if gate_by == "entropy" else 0.5)
        return LogitAverage(engines, p.weights, p.space, labels=labels, skip=skip, on_drop=on_drop, mode=p.mode,
                            lead=self.lead_index(), gate_by=gate_by, gate=gate, k=p.k or 4,
                            temperature=p.mixture_temperature, prompts=prompts, per_token=per_token)

    async def prompt_logprobs(self, call: Call, k: int) -> tuple[list[str], list[TokenLogprob | None]]:
        """The mixture's logprob of each prompt token (shared vocabulary: every member steps the same ids)."""
        if self.params.align == "topk_union":
            return await super().prompt_logprobs(call, k)
        if self.personas:
            raise InvalidRequest("members with their own system prompts read different prompts: there is no one "
                                 "prompt to score ('echo' with 'logprobs').", param="echo")
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
        distributions over the choices instead (always, with ``align: topk_union``, and with members that carry
        their own system prompts: each scores under its own prompt)."""
        if self.params.align == "topk_union" or combine == "probabilities" or self.personas:
            if combine == "tokens":
                why = "members with their own system prompts" if self.personas else "topk_union"
                raise InvalidRequest(f"combine 'tokens' needs one shared prompt and vocabulary; with {why} use "
                                     "'probabilities'.", param="combine")
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
        limit = min(m.engine.max_model_len for m in self.members)
        for m in self.members if self.personas else self.members[:1]:
            req = call.request(m)
            check_context(len(req.prompt_ids), req.params, limit)

    async def stream(self, call: Call) -> AsyncGenerator[Delta, None]:
        dropped: list[str] = []

        def on_drop(label: str, error: str) -> None:
            dropped.append(label)
            call.trace.setdefault("errors", []).append({"member": label, "error": error})

        own = self.personas or self.params.align == "topk_union"  # each member renders its own prompt
        reqs = [call.request(m) for m in self.members] if own else [call.request(self.members[0])] * len(self.members)
        prompts = [r.prompt_ids for r in reqs] if self.personas else None
        engine = self.engine(call.on_member_error == "skip", on_drop, prompts, per_token=call.detail)
        call.trace.update({"weights": engine.weights.tolist(), "space": self.params.space,
                           "align": self.params.align})
        if isinstance(engine, TopkUnion):
            call.trace["note"] = ("top-k union over token strings (UniTE): an approximation of the members' full "
                                  "distributions")
            deltas = engine.stream_requests(reqs)
        else:
            if engine.approximate:
                call.trace["note"] = (f"approximate: {', '.join(engine.approximate)} served remotely give only their "
                                      "top-k logprobs; other tokens count as probability 0 for them")
            lead = reqs[engine.lead]
            params = lead.params
            if params.max_tokens is None:  # up to the context window: the member with the longest prompt's
                params = replace(params, max_tokens=min(engine.max_model_len - len(r.prompt_ids) for r in reqs))
            deltas = engine.stream(GenerationRequest(lead.prompt_ids, params, extra_stop=tuple(
                dict.fromkeys(s for r in reqs for s in r.extra_stop))))
        emitted: list[int] = []
        try:
            async for d in deltas:
                if d.index == 0:
                    emitted.extend(d.token_ids)
                yield d
        finally:
            await deltas.aclose()
            if not isinstance(engine, TopkUnion) and engine.tally.agreement is not None:
                engine.tally.agreement.finish(emitted)
            if isinstance(engine, TopkUnion):
                for i, m in enumerate(self.members):
                    if m.label not in dropped:
                        call.record(m, len(reqs[i].prompt_ids), engine.fed[i])
            else:
                self.account(call, engine, reqs, dropped)

    def account(self, call: Call, engine: LogitAverage, reqs: list[GenerationRequest], dropped: list[str]) -> None:
        """Usage per member is what it computed: its prompt and the distributions after it (the first from the
        prompt, then one per token it read, drafts included; a selective member never consulted: nothing). The trace and
        Prometheus get the mode's figures: positions, where members were combined, catch-up, proposals."""
        stats = engine.tally
        for i, m in enumerate(self.members):
            if m.label not in dropped:
                call.record(m, len(reqs[i].prompt_ids) if stats.prompted[i] else 0, stats.fed[i] + stats.prompted[i])
        call.trace["token_ensemble"] = stats.as_trace()
        if stats.agreement is not None and stats.agreement.rows:  # mode full: how the members agreed per token
            call.trace["token_ensemble"]["tokens"] = stats.agreement.as_trace(engine.tokenizer.decode)
        mode = stats.mode
        TOKEN_POSITIONS.labels(call.ensemble, mode).inc(stats.positions)
        TOKEN_CONSULTED.labels(call.ensemble, mode).inc(stats.consulted)
        if mode == "selective":
            for m, n in zip(self.members, stats.catch_up):
                TOKEN_CATCH_UP.labels(call.ensemble, m.label).inc(n)
        if mode == "speculative":
            SPECULATIVE_PROPOSED.labels(call.ensemble).inc(stats.proposed)
            SPECULATIVE_ACCEPTED.labels(call.ensemble).inc(stats.accepted)
