"""``logit_average`` with ``align: topk_union``: members with different vocabularies (UniTE, docs/methods.md §1).

Every step, each member proposes its top-k tokens as *strings* (its tokenizer's text for the token, so
``Ġthe`` and ``▁the`` are both `` the``); the union of the strings is the step's vocabulary. A member
scores a string by its logit for that exact token if it has one, else for the first sub-token of the
string's own tokenisation; end-of-sequence is one shared entry scored by each member's EOS logit.
Per member a softmax over the union, weighted average, then the client's sampling acts on the result.
The chosen string is re-tokenised per member and fed to each member's own session (own KV cache,
own chat template for the prompt). It is an approximation of the members' full distributions; the
trace says so. Penalties (presence / frequency) do not apply to union entries.

Structured outputs: the grammar runs on the first member's tokenizer; a union string is a candidate only
if the grammar accepts its tokens there (EOS only where the output may end). When no string of the union
is allowed, the first member's best allowed token is the step's only candidate.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import torch

from chorus.engines.core.base import (
    LOGITS,
    TOPK_LOGITS,
    Delta,
    Engine,
    GenerationRequest,
    Session,
    TokenLogprob,
    TopLogprob,
)
from chorus.engines.core.constraint import Guide
from chorus.engines.core.detokenize import TextAssembler
from chorus.engines.core.generation import check_context, open_guide
from chorus.engines.core.sampling import logprob_info, make_generator, sample
from chorus.engines.core.vocab import vocab_of
from chorus.ensembles.call import Call, Member
from chorus.ensembles.logit_average.mixing import normalised_weights
from chorus.ensembles.logit_average.params import LogitAverageParams
from chorus.ensembles.logit_average.stepping import step_members
from chorus.errors import CapabilityMismatch, InvalidRequest

EOS = "\x00<eos>"  # the union entry for end-of-sequence


class TopkUnion:
    own_prompts = True  # each member renders the request with its own chat template and tokenizer
    scores_tokens = False  # no one tokenization to score: choices average the members' distributions

    def __init__(self, members: list[Engine], weights: Sequence[float] | None, top_k: int = 10,
                 labels: list[str] | None = None, skip: bool = False,
                 on_drop: Callable[[str, str], None] | None = None) -> None:
        if len(members) < 2:
            raise InvalidRequest("logit_average needs at least 2 members.", param="ensemble.members")
        self.members = members
        self.labels = labels or [m.name for m in members]
        lacking = [lb for lb, m in zip(self.labels, members) if not {LOGITS, TOPK_LOGITS} & m.capabilities]
        if lacking:
            raise CapabilityMismatch(f"topk_union needs members with logits or top-k logprobs; these have neither: "
                                     f"{', '.join(lacking)}.", param="ensemble.members")
        self.weights = normalised_weights(weights, len(members))
        self.top_k = top_k
        self.skip = skip
        self.on_drop = on_drop
        self.fed = [0] * len(members)  # tokens fed to each member (usage)

    @classmethod
    def for_members(cls, members: list[Member], p: LogitAverageParams, lead: int, personas: bool, skip: bool,
                    on_drop: Callable[[str, str], None] | None = None, prompts: list[list[int]] | None = None,
                    per_token: bool = True) -> TopkUnion:
        """The aligned engine of one request over ``members``, mixed as ``p`` says (``lead``: the lead's index;
        ``personas``: members carry their own system prompts)."""
        if personas:
            raise InvalidRequest("per-member system prompts need align: vocab (topk_union renders one prompt per "
                                 "member's own template already, from the request's messages).",
                                 param="ensemble.members")
        return cls([m.engine for m in members], p.weights, p.top_k,
                   labels=[m.label for m in members], skip=skip, on_drop=on_drop)

    @staticmethod
    def check_params(p: LogitAverageParams) -> None:
        if p.mode != "full":
            raise ValueError(f"mode {p.mode!r} needs one shared vocabulary (align: vocab); topk_union "
                             "ensembles run in mode 'full'")
        if p.space != "probability":
            raise ValueError("topk_union averages probabilities over the union's strings: space 'logit' needs "
                             "align 'vocab'")
        if p.mixture_temperature != 1.0:
            raise ValueError("mixture_temperature applies to align 'vocab'; topk_union mixes over the union's "
                             "strings without it")

    def stream_for(self, reqs: list[GenerationRequest], call: Call) -> AsyncGenerator[Delta, None]:
        call.trace["note"] = ("top-k union over token strings (UniTE): an approximation of the members' full "
                              "distributions")
        return self.stream_requests(reqs)

    def finish(self, call: Call, members: list[Any], reqs: list[GenerationRequest], dropped: list[str],
               emitted: list[int]) -> None:
        for i, m in enumerate(members):
            if m.label not in dropped:
                call.record(m, len(reqs[i].prompt_ids), self.fed[i], reqs[i].cached_tokens)

    def union_step(self, alive: list[int], logits: list[torch.Tensor]) -> tuple[list[str], torch.Tensor]:
        """The union of the members' top-k strings and the weighted average of their distributions over it."""
        union: dict[str, None] = {}
        for i, z in zip(alive, logits):
            v = vocab_of(self.members[i].tokenizer)
            for t in torch.topk(z[: len(v.strings)], self.top_k).indices.tolist():
                s = EOS if t in v.eos else v.strings[t]
                if s:
                    union.setdefault(s)
        strings = list(union)
        w = self.weights[alive]
        w = w / w.sum() if w.sum() > 0 else torch.full_like(w, 1 / len(alive))
        p = torch.zeros(len(strings))
        for wi, i, z in zip(w.tolist(), alive, logits):
            v = vocab_of(self.members[i].tokenizer)
            scores = torch.full((len(strings),), float("-inf"))
            for j, s in enumerate(strings):
                tid = None if s == EOS else v.first_id(s)
                if s == EOS:
                    scores[j] = z[v.eos].max() if v.eos else float("-inf")
                elif tid is not None:
                    scores[j] = z[tid]
            p += wi * torch.softmax(scores.float(), dim=-1)  # (U,)
        return strings, torch.log(p.clamp_min(1e-30))

    async def stream_requests(self, reqs: list[GenerationRequest]) -> AsyncGenerator[Delta, None]:
        """Generate from per-member requests (each in its member's own tokenisation); the first sets sampling."""
        lead = reqs[0].params
        steps = min(check_context(len(r.prompt_ids), r.params, m.max_model_len) for r, m in zip(reqs, self.members))
        stops = tuple(lead.stop) + tuple(dict.fromkeys(s for r in reqs for s in r.extra_stop))
        for index in range(lead.n):  # choices one after another
            seed = None if lead.seed is None else lead.seed + index
            async for d in self._choice(index, reqs, steps, stops, make_generator(seed)):
                yield d

    async def _choice(self, index: int, reqs: list[GenerationRequest], max_tokens: int, stops: tuple[str, ...],
                      generator: torch.Generator) -> AsyncGenerator[Delta, None]:
        params = reqs[0].params
        sessions: list[Session] = []
        try:
            for m in self.members:
                sessions.append(m.open_session(reqs[0].scope))
            alive = list(range(len(self.members)))
            await asyncio.to_thread(lambda: [vocab_of(m.tokenizer) for m in self.members])  # first use: build maps
            keep, logits = await step_members([s.prefill(r.prompt_ids) for s, r in zip(sessions, reqs)],
                                              self.labels, self.skip, self.on_drop)
            alive = [alive[k] for k in keep]
            pieces: list[str] = []
            assembler = TextAssembler(lambda ids: "".join(pieces[i] for i in ids), stops)
            guide = await open_guide(params.constraint, self.members[0].tokenizer)
            for produced in range(1, max_tokens + 1):
                strings, logp = self.union_step(alive, logits)
                if guide is not None:
                    strings, logp = self.allowed(guide, strings, logp, logits[0] if alive[0] == 0 else None)
                j = sample(logp, params, generator, {})
                lps = [self.logprob(strings, logp, j, params.top_logprobs)] if params.logprobs else []
                if strings[j] == EOS and (guide is not None or not params.ignore_eos):
                    yield Delta(index, assembler.flush(), [j], lps, "stop")
                    return
                if guide is not None:
                    guide.accept_all(vocab_of(self.members[0].tokenizer).pieces(strings[j]))
                pieces.append("" if strings[j] == EOS else strings[j])
                text = assembler.push(len(pieces) - 1)
                done = assembler.stopped or (guide is not None and guide.stopped)
                if done or produced == max_tokens:
                    finish = "stop" if done else "length"
                    yield Delta(index, text + assembler.flush(), [j], lps, finish)
                    return
                yield Delta(index, text, [j], lps)
                keep, logits = await step_members([self._feed(i, sessions[i], strings[j]) for i in alive],
                                                  [self.labels[i] for i in alive], self.skip, self.on_drop)
                alive = [alive[k] for k in keep]
        finally:
            for s in sessions:
                s.close()

    def allowed(self, guide: Guide, strings: list[str], logp: torch.Tensor,
                first: torch.Tensor | None) -> tuple[list[str], torch.Tensor]:
        """The union with the strings the grammar forbids next at -inf (on the first member's tokenizer).
        If it forbids them all: the first member's best allowed token alone (``first``: its logits, None
        when it was dropped: any allowed token)."""
        v = vocab_of(self.members[0].tokenizer)
        ok = torch.tensor([guide.accepting if s == EOS else guide.allows(v.pieces(s)) for s in strings])
        if bool(ok.any()):
            return strings, logp.masked_fill(~ok, float("-inf"))
        masked = guide.mask(first if first is not None else torch.zeros(len(v.strings)))
        t = int(torch.argmax(masked))
        return [EOS if t in v.eos else v.strings[t]], torch.zeros(1)

    async def _feed(self, i: int, session: Session, s: str) -> torch.Tensor:
        v = vocab_of(self.members[i].tokenizer)
        ids = v.eos[:1] if s == EOS else v.pieces(s)
        logits = None
        for t in ids:
            logits = await session.step(t)
            self.fed[i] += 1
        if logits is None:
            raise RuntimeError(f"{s!r} tokenises to nothing")
        return logits

    @staticmethod
    def logprob(strings: list[str], logp: torch.Tensor, j: int, k: int) -> TokenLogprob:
        lp, top = logprob_info(logp, j, k)
        return TokenLogprob(strings[j], j, lp, [TopLogprob(strings[t], v) for t, v in top])
