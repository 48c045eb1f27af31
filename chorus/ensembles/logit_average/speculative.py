"""``logit_average`` with ``mode: speculative``: full averaging's output at fewer forwards (docs/methods.md §1).

Each round the lead drafts ``k`` tokens greedily from its own distribution (k one-token steps); the
other members read the round's tokens in one forward each (`Session.extend`), which gives the
ensemble's mixture at every drafted position at once. The decode loop then samples each token from
the mixture exactly as full averaging does (same sampler, same random draws); while the sampled
token equals the draft, the next position's mixture is already computed and costs nothing. At the
first token that differs, every member rolls back the drafts it read past it (`Session.rollback`)
and a new round starts from the sampled token.

While the others verify a round, the lead already drafts the next one, betting that its last draft
will be the token sampled there: the members work in parallel (as full averaging's do), and a lost bet
costs the lead a rollback. At the end of the text there is no next round to draft.

So the output is full averaging's, token for token, under greedy decoding and under sampling with a
seed (verification is "sample from the target, accept while it matches the draft"; rejection
sampling against the draft would accept more often at high temperature but draws differently).
What is saved is the other members' forwards: one per round instead of one per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from chorus.engines.core.base import Session
from chorus.ensembles.call import gather
from chorus.ensembles.logit_average.stepping import EnsembleStats, LeadSessionBase
from chorus.ensembles.metrics import SPECULATIVE_ACCEPTED, SPECULATIVE_PROPOSED

if TYPE_CHECKING:
    from chorus.ensembles.logit_average.shared_vocab import LogitAverage


class SpeculativeSession(LeadSessionBase):
    """One sequence: the lead drafts, the others verify a round in one forward, rejected drafts roll back."""

    options = frozenset({"lead", "k"})

    def __init__(self, members: list[Session], owner: LogitAverage) -> None:
        super().__init__(members, owner)
        self.k = owner.mixing.k
        self.max_len = owner.max_model_len
        self.eos = owner.tokenizer.eos_token_ids
        self.drafts: list[int] = []  # this round's drafts not yet sampled; all but the last were fed
        self.ahead: list[torch.Tensor] = []  # the mixture after each fed draft, in order
        self.prefetched: list[int] = []  # the next round, drafted (and read by the lead) while the others verify
        self.prefetched_rows: list[torch.Tensor] = []

    @classmethod
    def trace(cls, stats: EnsembleStats) -> dict[str, Any]:
        return {"proposed": stats.proposed, "accepted": stats.accepted, "rounds": stats.rounds,
                "acceptance": round(stats.accepted / stats.proposed, 4) if stats.proposed else 0.0,
                "mean_accepted": round(stats.accepted / stats.rounds, 3) if stats.rounds else 0.0,
                "rolled_back": dict(zip(stats.labels, stats.rolled_back))}

    @classmethod
    def count(cls, ensemble: str, stats: EnsembleStats) -> None:
        SPECULATIVE_PROPOSED.labels(ensemble).inc(stats.proposed)
        SPECULATIVE_ACCEPTED.labels(ensemble).inc(stats.accepted)

    @property
    def length(self) -> int:
        return self.members[self.lead].length - len(self.ahead) - len(self.prefetched)

    async def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        others = [i for i in self.alive if i != self.lead]
        lead = await self._lead_call(self.members[self.lead].prefill(self._prompt_of(self.lead, ids)))
        kept, rest = await self._run([self.members[i].prefill(self._prompt_of(i, ids)) for i in others], others)
        self.stats.positions += 1
        self.stats.consulted += 1
        return self._mix([lead, *rest], [self.lead, *kept])

    async def step(self, token: int) -> torch.Tensor:
        token = int(token)
        if self.drafts and token == self.drafts[0]:
            self.drafts.pop(0)
            self.stats.accepted += 1
            if self.ahead:  # every member already read this token: its mixture is here
                self.stats.positions += 1
                self.stats.consulted += 1
                return self.ahead.pop(0)
            return await self._round(token)  # the round's last draft: the lead's next drafts may be ready
        # the sampled token differs from the draft: forget the drafts read past it (the lead also forgets
        # the next round it drafted ahead)
        for i in self.alive:
            n = len(self.ahead) + (len(self.prefetched) if i == self.lead else 0)
            if n:
                self.members[i].rollback(n)
                self.stats.rolled_back[i] += n
        self.drafts, self.ahead, self.prefetched, self.prefetched_rows = [], [], [], []
        return await self._round(token)

    async def _draft(self, first: int, room: int) -> tuple[list[int], list[torch.Tensor]]:
        """The lead reads ``first`` and drafts greedily until it has read up to ``min(k, room)`` tokens (or
        drafts an end of sequence): the tokens it read and its logits after each."""
        lead = self.members[self.lead]
        fed, rows = [first], []
        while True:
            q = await self._lead_call(lead.step(fed[-1]))
            rows.append(q)
            draft = int(torch.argmax(q[: self.vocab]))
            if len(fed) >= min(self.k, room) or draft in self.eos:
                return fed, rows
            fed.append(draft)

    async def _round(self, first: int) -> torch.Tensor:
        """Feed ``first`` and the lead's drafts after it to the others in one forward each. While they read
        them, the lead already drafts the next round, betting that its last draft will be the sampled token
        (its members run in parallel, as in full averaging); a wrong bet is rolled back."""
        lengths = {i: self.members[i].length for i in self.alive}
        if self.prefetched and self.prefetched[0] == first:
            fed, lead_rows = self.prefetched, self.prefetched_rows
        else:
            fed, lead_rows = await self._draft(first, max(1, self.max_len - max(lengths.values())))
        self.prefetched, self.prefetched_rows = [], []
        drafts = [int(torch.argmax(x[: self.vocab])) for x in lead_rows]
        others = [i for i in self.alive if i != self.lead]
        # room for the next round: the lead has read this round already, the others will have
        ahead_room = self.max_len - max([self.members[self.lead].length] + [lengths[i] + len(fed) for i in others])
        verify = self._run([self.members[i].extend(fed) for i in others], others)
        if ahead_room >= 1 and drafts[-1] not in self.eos:
            (kept, rows), (self.prefetched, self.prefetched_rows) = await gather(
                verify, self._draft(drafts[-1], ahead_room))
        else:
            kept, rows = await verify
        for i in [self.lead, *kept]:
            self.stats.fed[i] += len(fed)
        mixtures = [self._mix([lead_rows[j], *(r[j] for r in rows)], [self.lead, *kept]) for j in range(len(fed))]
        self.drafts = drafts
        self.ahead = mixtures[1:]
        self.stats.rounds += 1
        self.stats.proposed += len(self.drafts)
        self.stats.positions += 1
        self.stats.consulted += 1
        return mixtures[0]
