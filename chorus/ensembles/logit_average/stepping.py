"""Token-level stepping shared by the logit-averaging parts (``shared_vocab.py`` and its modes ``full.py``,
``selective.py``, ``speculative.py``; ``topk_union.py`` across vocabularies): what a request's token ensemble
did (`EnsembleStats`), the per-token agreement, one step of every member with failures named or dropped, and
`MemberSessions`, the base of every mode's session."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from chorus.ensembles.call import message
from chorus.ensembles.logit_average.mixing import Mixing, mix
from chorus.errors import InvalidRequest, MemberFailed


class Owner(Protocol):
    """What member sessions read from the engine that opened them (shared_vocab.py's `LogitAverage`)."""

    mixing: Mixing
    weights: torch.Tensor
    vocab: int
    labels: list[str]
    tally: Any
    prompts: list[list[int]] | None
    skip: bool
    on_drop: Callable[[str, str], None] | None

    def closed(self, session: MemberSessions) -> None:
        """The session closed: forget it."""


class TokenAgreement:
    """Per generated token of one sequence (the request's first): each member's probability of the token the
    ensemble chose, the share of members whose own top-1 it was (``agreement``), and each member's top tokens.

    A session reports the members' distributions at its last position (`observe`, kept by reference, nothing
    computed) and the tokens it is then fed (`fed`): the first resolves the pending position. The last token
    is never fed; `finish` resolves it from the emitted ids. Only the first ``limit`` tokens are kept."""

    def __init__(self, labels: list[str], limit: int = 256, k: int = 3) -> None:
        self.labels, self.limit, self.k = labels, limit, k
        self.rows: list[dict[str, Any]] = []
        self._pending: tuple[list[int], list[torch.Tensor]] | None = None

    def observe(self, which: list[int], logits: Sequence[torch.Tensor]) -> None:
        self._pending = (which, [x.detach().float().clone() for x in logits]) if len(self.rows) < self.limit \
            else None

    def fed(self, ids: Sequence[int], rows: Sequence[Sequence[torch.Tensor]] = ()) -> None:
        """``ids`` were fed after the pending position; ``rows[j]``: the members' logits after ``ids[j]``."""
        for j, token in enumerate(ids):
            if self._pending is not None:
                self._resolve(token)
            if j < len(rows):
                self.observe(self._pending[0] if self._pending else list(range(len(rows[j]))), rows[j])

    def rollback(self, n: int) -> None:
        del self.rows[len(self.rows) - min(n, len(self.rows)):]
        self._pending = None

    def finish(self, emitted: Sequence[int]) -> None:
        """The tokens sequence 0 emitted: the pending position resolved with the last, if it was not fed."""
        if self._pending is not None and len(emitted) == len(self.rows) + 1:
            self._resolve(emitted[-1])
        self._pending = None

    def _resolve(self, token: int) -> None:
        assert self._pending is not None
        which, logits = self._pending
        self._pending = None
        p: dict[str, float] = {}
        top: dict[str, list[tuple[int, float]]] = {}
        agree = 0
        for i, z in zip(which, logits):
            probs = torch.softmax(z, dim=-1)
            vals, idx = probs.topk(self.k)
            p[self.labels[i]] = round(float(probs[token]), 6) if token < probs.numel() else 0.0
            top[self.labels[i]] = [(int(t), round(float(v), 6)) for t, v in zip(idx, vals)]
            agree += int(idx[0]) == token
        self.rows.append({"id": token, "agreement": round(agree / len(which), 4), "p": p, "top": top})

    def as_trace(self, decode: Callable[[list[int]], str]) -> list[dict[str, Any]]:
        """Rows with the token's text (an end-of-sequence token, whose text is empty, is left out)."""
        return [{"text": text, "agreement": r["agreement"], "p": r["p"],
                 "top": {lb: [[decode([t]), v] for t, v in tops] for lb, tops in r["top"].items()}}
                for r in self.rows if (text := decode([r["id"]]))]


@dataclass
class EnsembleStats:
    """What one request's token ensemble did: positions decoded, positions where the members were
    combined (consulted), tokens each member was fed, speculative proposals made and accepted."""

    labels: list[str]
    mode: str = "full"
    #: every member reads the prompt at once (else, selective, a member prompts when first consulted)
    eager: bool = True
    positions: int = 0
    consulted: int = 0
    fed: list[int] = field(default_factory=list)
    catch_up: list[int] = field(default_factory=list)  # tokens fed in a lagging member's catch-up chunks
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0
    rolled_back: list[int] = field(default_factory=list)
    prompted: list[bool] = field(default_factory=list)  # whether the member read its prompt at all
    agreement: TokenAgreement | None = None  # mode full: per-token agreement of the first sequence
    #: keep the per-token agreement (two softmaxes and a top-k per member and token): the mode keeps one, and
    #: only a trace shows it
    per_token: bool = True
    _claimed: bool = False

    def __post_init__(self) -> None:
        n = len(self.labels)
        self.fed, self.catch_up, self.rolled_back = [0] * n, [0] * n, [0] * n
        self.prompted = [self.eager] * n
        if self.per_token:
            self.agreement = TokenAgreement(self.labels)

    def claim(self) -> TokenAgreement | None:
        """The per-token record, for the first generating session only (n > 1: the other choices are not kept)."""
        if self._claimed:
            return None
        self._claimed = True
        return self.agreement

    def as_trace(self) -> dict[str, Any]:
        """What every mode reports; a mode's session class adds its own figures (``trace``)."""
        return {"mode": self.mode, "positions": self.positions, "consulted": self.consulted,
                "ensembled_share": round(self.consulted / self.positions, 4) if self.positions else 0.0,
                "fed": dict(zip(self.labels, self.fed))}



async def step_members(calls: Sequence[Awaitable[torch.Tensor]], labels: Sequence[str], skip: bool,
                       on_drop: Callable[[str, str], None] | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """Run one step of every member concurrently: (indices of the members still in, their logits).

    A member that fails raises `MemberFailed` naming it, unless ``skip`` (and another member is left):
    then it is reported to ``on_drop`` and left out. Client errors (context length) pass through.
    """
    results = await asyncio.gather(*calls, return_exceptions=True)
    failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
    for _, r in failed:
        if isinstance(r, InvalidRequest) or not isinstance(r, Exception):
            raise r
    if failed and (not skip or len(failed) == len(results)):
        i, r = failed[0]
        raise MemberFailed(f"ensemble member {labels[i]!r} failed: {message(r)}", param="ensemble.members") from r
    for i, r in failed:
        if on_drop is not None:
            on_drop(labels[i], message(r))
    keep = [i for i, r in enumerate(results) if not isinstance(r, BaseException)]
    return keep, [results[i] for i in keep]  # type: ignore[misc]


class MemberSessions:
    """One sequence of a token ensemble: each member's own session and the engine that opened it (``owner``: its
    `Mixing`, weights, vocabulary, labels, each member's own prompt or none, the request's `EnsembleStats`,
    whether a failed member is skipped). ``alive``: the members still in (a member that fails is dropped with
    ``skip``, else the request fails naming it). Closing it closes every member's session.

    A mode (registry.py) is a subclass: its ``options`` (the parameters only it takes), whether every member
    reads the prompt at once (``eager``) and keeps the per-token agreement (``agreement``), its figures for the
    trace (``trace``) and Prometheus (``count``)."""

    options: ClassVar[frozenset[str]] = frozenset()
    eager: ClassVar[bool] = True
    agreement: ClassVar[bool] = False

    def __init__(self, members: list[Any], owner: Owner) -> None:
        mixing = owner.mixing
        self.members = members
        self.owner = owner
        self.weights = owner.weights
        self.space = mixing.space
        self.vocab = owner.vocab
        self.labels = list(owner.labels)
        self.stats = owner.tally
        self.temperature = mixing.temperature
        self.prompts = owner.prompts
        self.skip = owner.skip
        self._on_drop = owner.on_drop
        self.alive = list(range(len(members)))

    def generating(self) -> None:
        """This session generates (not a scoring one): a mode that keeps the per-token agreement claims it."""

    @classmethod
    def new_stats(cls, name: str, labels: list[str], per_token: bool) -> EnsembleStats:
        return EnsembleStats(labels, name, eager=cls.eager, per_token=per_token and cls.agreement)

    @classmethod
    def trace(cls, stats: EnsembleStats) -> dict[str, Any]:
        """The mode's own figures in the request's trace."""
        return {}

    @classmethod
    def count(cls, ensemble: str, stats: EnsembleStats) -> None:
        """The mode's own Prometheus counters for one request."""

    def _prompt_of(self, i: int, ids: Sequence[int]) -> list[int]:
        return self.prompts[i] if self.prompts is not None else list(ids)

    def _mix(self, logits: Sequence[torch.Tensor], which: list[int]) -> torch.Tensor:
        """The distributions of members ``which`` (in that order) combined with their weights."""
        return mix(logits, self.weights[which], self.space, self.vocab, self.temperature)

    async def _run(
        self, calls: list[Awaitable[torch.Tensor]], which: list[int]
    ) -> tuple[list[int], list[torch.Tensor]]:
        """Calls of members ``which``, concurrently: the members still in and their results. A failed member
        fails the request, or (``skip``) is closed and dropped."""
        keep, results = await step_members(calls, [self.labels[i] for i in which], self.skip, self._on_drop)
        for gone in set(which) - {which[k] for k in keep}:
            self.members[gone].close()
            self.alive.remove(gone)
        return [which[k] for k in keep], results

    def close(self) -> None:
        for m in self.members:
            m.close()
        self.owner.closed(self)


class LeadSessionBase(MemberSessions):
    """What the selective and speculative sessions share: one member, the lead, decodes; a failed lead fails
    the request. They are driven token by token by the decode loop (``extend`` steps each token) and cannot
    be rolled back themselves."""

    options = frozenset({"lead"})

    def __init__(self, members: list[Any], owner: Owner) -> None:
        super().__init__(members, owner)
        self.lead = owner.mixing.lead

    async def _lead_call(self, call: Awaitable[torch.Tensor]) -> torch.Tensor:
        _, (logits,) = await step_members([call], [self.labels[self.lead]], False)
        return logits

    async def step(self, token: int) -> torch.Tensor:  # pragma: no cover - each mode implements it
        raise NotImplementedError

    async def extend(self, ids: Sequence[int]) -> torch.Tensor:
        return torch.stack([await self.step(t) for t in ids])

    def rollback(self, n: int) -> None:
        raise InvalidRequest(f"a {type(self).__name__} cannot roll back")
