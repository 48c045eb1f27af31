"""``logit_average`` with ``mode: selective`` (SAFE-style, docs/methods.md §1): ensemble only where it pays.

One member, the lead, decodes every token. The others are consulted only at positions where a gate
fires on the lead's own next-token distribution: its top-1 probability below ``gate`` (``gate_by:
top1``) or its entropy above ``gate`` nats (``gate_by: entropy``). Elsewhere the lead's distribution is
the answer, at the lead's own cost. A member that was not consulted does not run: the tokens it missed
wait in its backlog and are fed in one chunk (`Session.extend`, one forward) when it is next consulted,
so its KV cache is exactly what it would be had it stepped every token. A member never consulted never
even prefills its prompt. At consulted positions the mixture may be sharpened (``mixture_temperature``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from chorus.engines.core.base import Session
from chorus.ensembles.logit_average.stepping import EnsembleStats, LeadSessionBase
from chorus.ensembles.metrics import TOKEN_CATCH_UP

if TYPE_CHECKING:
    from chorus.ensembles.logit_average.shared_vocab import LogitAverage


def uncertain(logits: torch.Tensor, gate_by: str, gate: float) -> bool:
    """Whether the lead is unsure of its next token: top-1 probability below, or entropy above, ``gate``."""
    p = torch.softmax(logits.float(), dim=-1)
    if gate_by == "entropy":
        return float(-(p * torch.log(p.clamp_min(1e-30))).sum()) > gate
    return float(p.max()) < gate


class SelectiveSession(LeadSessionBase):
    """One sequence: the lead's session stepped every token, the others' only when consulted."""

    options = frozenset({"lead", "gate", "gate_by"})
    eager = False  # the others prefill when first consulted

    def __init__(self, members: list[Session], owner: LogitAverage) -> None:
        super().__init__(members, owner)
        self.gate_by = owner.mixing.gate_by
        self.gate = owner.mixing.gate
        self.started = [i == self.lead for i in range(len(members))]  # the others prefill when first consulted
        self.backlog: list[list[int]] = [[] for _ in members]
        self.prompt: list[int] = []

    @classmethod
    def trace(cls, stats: EnsembleStats) -> dict[str, Any]:
        return {"catch_up": dict(zip(stats.labels, stats.catch_up))}

    @classmethod
    def count(cls, ensemble: str, stats: EnsembleStats) -> None:
        for label, n in zip(stats.labels, stats.catch_up):
            TOKEN_CATCH_UP.labels(ensemble, label).inc(n)

    @property
    def length(self) -> int:
        return self.members[self.lead].length

    async def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        self.prompt = list(ids)
        self.stats.prompted[self.lead] = True
        lead = self.members[self.lead].prefill(self._prompt_of(self.lead, ids))
        return await self._decide(await self._lead_call(lead))

    async def step(self, token: int) -> torch.Tensor:
        logits = await self._lead_call(self.members[self.lead].step(token))
        self.stats.fed[self.lead] += 1
        for i in self.alive:
            if i != self.lead:
                self.backlog[i].append(int(token))
        return await self._decide(logits)

    async def _decide(self, lead: torch.Tensor) -> torch.Tensor:
        self.stats.positions += 1
        others = [i for i in self.alive if i != self.lead]
        lead = lead[: self.vocab]
        if not others or not uncertain(lead, self.gate_by, self.gate):
            return lead
        self.stats.consulted += 1
        kept, results = await self._run([self._catch_up(i) for i in others], others)
        return self._mix([lead, *results], [self.lead, *kept])

    async def _catch_up(self, i: int) -> torch.Tensor:
        """Member i's next-token logits after everything so far: the tokens it missed, in one chunk."""
        missed, self.backlog[i] = self.backlog[i], []
        self.stats.fed[i] += len(missed)
        self.stats.catch_up[i] += len(missed)
        if not self.started[i]:
            self.started[i] = self.stats.prompted[i] = True
            return await self.members[i].prefill(self._prompt_of(i, self.prompt) + missed)
        return (await self.members[i].extend(missed))[-1]
