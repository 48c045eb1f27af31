"""``mode: full`` of ``logit_average``: every member at every token (docs/methods.md §1)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from chorus.ensembles.logit_average.stepping import MemberSessions, TokenAgreement


class AveragedSession(MemberSessions):
    """One sequence of the ensemble (``mode: full``): every member's session stepped together.

    A member that fails raises `MemberFailed` naming it, or (``skip``) is dropped and the remaining
    weights renormalised; ``on_drop(label, error)`` reports it. ``prompts``: each member's own prompt
    (a prompt ensemble: members with their own system messages); otherwise all read the same ids.
    """

    agreement = True  # the trace's per-token agreement (of the request's first generating session: `record`)
    record: TokenAgreement | None = None

    def generating(self) -> None:
        self.record = self.stats.claim()

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
