"""Token-level stepping shared by the two logit-averaging modes (``logit_average.py`` for one shared
vocabulary, ``topk_union.py`` across vocabularies): member weights, and one step of every member
with failures named or dropped."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import torch

from chorus.ensembles.base import message
from chorus.ensembles.spec import member_weights
from chorus.errors import InvalidRequest, MemberFailed


def normalised_weights(weights: Sequence[float] | None, n: int) -> torch.Tensor:
    return torch.tensor(member_weights(weights, n), dtype=torch.float32)



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
