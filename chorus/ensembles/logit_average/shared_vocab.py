"""``align: vocab`` of ``logit_average``: members over one shared vocabulary, combined token by token.

One session (own KV cache) per member per request. Each step combines the members' next-token distributions by
the request's `Mixing` (mixing.py); the decode loop's sampling then acts on the combined distribution, and the
chosen token is fed to every member. Because members' sessions live in their engines' batch runners, concurrent
ensemble requests batch like single-model ones. `LogitAverage` is itself an engine (a `SessionEngine`), so
generation, streaming, stop strings, n, seeds and logprobs work exactly as for one model; the mode (registry.py)
decides which members a position consults.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import replace
from typing import Any

from chorus.engines.core.base import LOGITS, TOPK_LOGITS, Delta, Engine, GenerationRequest, Session
from chorus.engines.core.generation import SessionEngine
from chorus.engines.core.request_scope import RequestScope
from chorus.engines.core.scoring import mixture_logprob
from chorus.ensembles.call import Call, Member, gather
from chorus.ensembles.logit_average.mixing import SPACES, Mixing, normalised_weights
from chorus.ensembles.logit_average.params import LogitAverageParams
from chorus.ensembles.logit_average.registry import mode_class
from chorus.ensembles.logit_average.stepping import MemberSessions
from chorus.ensembles.metrics import TOKEN_CONSULTED, TOKEN_POSITIONS
from chorus.errors import CapabilityMismatch, InvalidRequest


class LogitAverage(SessionEngine):
    """Members over one vocabulary, combined token by token by ``mixing``; itself an engine. ``tally`` sums what
    this engine's sessions did (an ensemble request builds its own engine). ``prompts``: each member's own prompt
    (a prompt ensemble), else all read the same ids; ``skip``: a failed member is dropped (``on_drop`` is told)
    rather than failing the request; ``per_token``: keep the trace's per-token agreement."""

    requires = frozenset({LOGITS})
    own_prompts = False  # the members read one prompt (unless they carry their own system prompts)
    scores_tokens = True  # prompt logprobs and choices scored per token of the mixture

    def __init__(self, members: list[Engine], mixing: Mixing | None = None, *, name: str = "logit_average",
                 labels: list[str] | None = None, skip: bool = False,
                 on_drop: Callable[[str, str], None] | None = None, prompts: list[list[int]] | None = None,
                 per_token: bool = True) -> None:
        mixing = mixing or Mixing()
        if len(members) < 2:
            raise InvalidRequest("logit_average needs at least 2 members.", param="ensemble.members")
        self.labels = labels or [m.name for m in members]
        lacking = [lb for lb, m in zip(self.labels, members) if not {LOGITS, TOPK_LOGITS} & m.capabilities]
        if lacking:
            raise CapabilityMismatch(f"logit_average needs members with next-token logits (in-process) or top-k "
                                     f"logprobs (remote, api: completions); these have neither: "
                                     f"{', '.join(lacking)}.", param="ensemble.members")
        self.approximate = [lb for lb, m in zip(self.labels, members) if LOGITS not in m.capabilities]
        if self.approximate and mixing.space == "logit":
            raise InvalidRequest(f"space 'logit' needs full logits; {', '.join(self.approximate)} give only top-k "
                                 "logprobs. Use space 'probability'.", param="ensemble.space")
        base = members[0].tokenizer.fingerprint
        differ = [lb for lb, m in zip(self.labels, members) if m.tokenizer.fingerprint != base]
        if differ:
            raise CapabilityMismatch(
                f"logit_average needs members that share one vocabulary; {', '.join(differ)} differ from "
                f"{self.labels[0]}. Use \"align\": \"topk_union\" to ensemble different vocabularies.",
                param="ensemble.members")
        if mixing.space not in SPACES:
            raise InvalidRequest(f"'space' must be one of {', '.join(SPACES)}.", param="ensemble.space")
        try:
            self.mode = mode_class(mixing.mode)
        except ValueError as exc:
            raise InvalidRequest(str(exc) + ".", param="ensemble.mode") from None
        if not 0 <= mixing.lead < len(members):
            raise InvalidRequest(f"'lead' must name one of the {len(members)} members.", param="ensemble.lead")
        self.name = name
        self.members = members
        self.mixing = mixing
        self.weights = normalised_weights(mixing.weights, len(members))
        self.skip = skip
        self.on_drop = on_drop
        self.prompts = prompts
        self.tally = self.mode.new_stats(mixing.mode, self.labels, per_token)
        self.tokenizer = members[0].tokenizer
        self.sampling_defaults = dict(members[0].sampling_defaults)
        self.max_model_len = min(m.max_model_len for m in members)
        self.vocab = self.tokenizer.vocab_size
        self._open: set[MemberSessions] = set()

    @classmethod
    def for_members(cls, members: list[Member], p: LogitAverageParams, lead: int, personas: bool, skip: bool,
                    on_drop: Callable[[str, str], None] | None = None, prompts: list[list[int]] | None = None,
                    per_token: bool = True) -> LogitAverage:
        """The aligned engine of one request over ``members``, mixed as ``p`` says (``lead``: the lead's index;
        ``personas``: members carry their own system prompts)."""
        gate_by = p.gate_by or "top1"
        mixing = Mixing(weights=tuple(p.weights) if p.weights is not None else None, space=p.space, mode=p.mode,
                        lead=lead, gate_by=gate_by,
                        gate=p.gate if p.gate is not None else (1.0 if gate_by == "entropy" else 0.5),
                        k=p.k or 4, temperature=p.mixture_temperature)
        return cls([m.engine for m in members], mixing, labels=[m.label for m in members],
                   skip=skip, on_drop=on_drop, prompts=prompts, per_token=per_token)

    @staticmethod
    def check_params(p: LogitAverageParams) -> None:
        if "top_k" in p.model_fields_set:
            raise ValueError("'top_k' applies to align 'topk_union' (one shared vocabulary averages every token)")

    def _member_sessions(self, scope: RequestScope | None) -> list[Session]:
        sessions: list[Session] = []
        try:
            for m in self.members:
                sessions.append(m.open_session(scope))
        except BaseException:
            for s in sessions:
                s.close()
            raise
        return sessions

    def open_session(self, scope: RequestScope | None = None) -> Session:
        session = self._open_session(self.mode, scope)
        session.generating()
        return session

    def _open_session(self, mode: type[MemberSessions], scope: RequestScope | None) -> Any:
        session = mode(self._member_sessions(scope), self)
        self._open.add(session)
        return session

    def closed(self, session: MemberSessions) -> None:
        self._open.discard(session)

    @property
    def active_sessions(self) -> int:
        return len(self._open)

    def scoring_session(self, scope: RequestScope | None = None) -> Session:
        """Scoring reads the full mixture whatever the mode (a selective session would give the lead's)."""
        return self._open_session(mode_class("full"), scope)

    async def score_continuations(self, prefix: list[int], continuations: list[list[int]],
                                  scope: RequestScope | None = None) -> list[list[float]]:
        """Probability space: each member scores the continuations its own (fastest) way and each token's
        mixture logprob is ``log sum_i w_i p_i(token)``, which needs only the members' logprobs of that
        token. Logit space needs whole distributions: the generic way, stepping averaged sessions."""
        if self.mixing.space == "logit":
            return await super().score_continuations(prefix, continuations, scope)
        weights = self.weights.tolist()
        scored = await gather(*(m.score_continuations(prefix, continuations, scope) for m in self.members))
        return [mixture_logprob([member[i] for member in scored], weights) for i in range(len(continuations))]

    def stream_for(self, reqs: list[GenerationRequest], call: Call) -> AsyncGenerator[Delta, None]:
        """The ensemble's reply to one request (``reqs``: each member's rendering of it; the lead's sets the
        sampling): one decode over the mixture."""
        if self.approximate:
            call.trace["note"] = (f"approximate: {', '.join(self.approximate)} served remotely give only their "
                                  "top-k logprobs; other tokens count as probability 0 for them")
        lead = reqs[self.mixing.lead]
        params = lead.params
        if params.max_tokens is None:  # up to the context window: the member with the longest prompt's
            params = replace(params, max_tokens=min(self.max_model_len - len(r.prompt_ids) for r in reqs))
        return self.stream(GenerationRequest(lead.prompt_ids, params, extra_stop=tuple(
            dict.fromkeys(s for r in reqs for s in r.extra_stop)), scope=call.scope))

    def finish(self, call: Call, members: list[Any], reqs: list[GenerationRequest], dropped: list[str],
               emitted: list[int]) -> None:
        """Usage per member is what it computed: its prompt and the distributions after it (the first from the
        prompt, then one per token it read, drafts included; a selective member never consulted: nothing). The
        trace and Prometheus get the mode's figures: positions, where members were combined, and its own."""
        stats = self.tally
        if stats.agreement is not None:
            stats.agreement.finish(emitted)
        for i, m in enumerate(members):
            if m.label not in dropped:
                call.record(m, len(reqs[i].prompt_ids) if stats.prompted[i] else 0, stats.fed[i] + stats.prompted[i])
        call.trace["token_ensemble"] = {**stats.as_trace(), **self.mode.trace(stats)}
        if stats.agreement is not None and stats.agreement.rows:  # how the members agreed per token
            call.trace["token_ensemble"]["tokens"] = stats.agreement.as_trace(self.tokenizer.decode)
        TOKEN_POSITIONS.labels(call.ensemble, stats.mode).inc(stats.positions)
        TOKEN_CONSULTED.labels(call.ensemble, stats.mode).inc(stats.consulted)
        self.mode.count(call.ensemble, stats)
