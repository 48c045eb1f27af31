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
from typing import Any

import torch

from chorus.engines.core.base import Session
from chorus.ensembles.stepping import LeadSessionBase


def uncertain(logits: torch.Tensor, gate_by: str, gate: float) -> bool:
    """Whether the lead is unsure of its next token: top-1 probability below, or entropy above, ``gate``."""
    p = torch.softmax(logits.float(), dim=-1)
    if gate_by == "entropy":
        return float(-(p * torch.log(p.clamp_min(1e-30))).sum()) > gate
    return float(p.max()) < gate


class SelectiveSession(LeadSessionBase):
    """One sequence: the lead's session stepped every token, the others' only when consulted."""

    def __init__(self, members: list[Session], *, gate_by: str, gate: float, **common: Any) -> None:
        super().__init__(members, **common)
        self.gate_by = gate_by
        self.gate = gate
        self.started = [i == self.lead for i in range(len(members))]  # the others prefill when first consulted
        self.backlog: list[list[int]] = [[] for _ in members]
        self.prompt: list[int] = []

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
