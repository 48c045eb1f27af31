"""How a token ensemble's members combine: `Mixing`, fixed for a request and passed down whole (the engine, its
sessions and their modes read it), and `mix`, the combination itself."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from chorus.ensembles.spec import member_weights

SPACES = ("probability", "logit")


@dataclass(frozen=True)
class Mixing:
    """``weights``: one per member (normalised; default equal); ``space``: ``probability`` (``p = sum_i w_i
    softmax(z_i)``) or ``logit`` (``z = sum_i w_i z_i``); ``temperature`` divides the combined log-probabilities
    (< 1 sharpens); ``mode`` (registry.py): ``full``, ``selective`` (consult the others where the ``lead`` is
    unsure: top-1 below ``gate`` or entropy above it, ``gate_by``) or ``speculative`` (the lead drafts ``k``)."""

    weights: Sequence[float] | None = None
    space: str = "probability"
    mode: str = "full"
    lead: int = 0
    gate_by: str = "top1"
    gate: float = 0.5
    k: int = 4
    temperature: float = 1.0


def normalised_weights(weights: Sequence[float] | None, n: int) -> torch.Tensor:
    return torch.tensor(member_weights(weights, n), dtype=torch.float32)


def mix(logits: Sequence[torch.Tensor], weights: torch.Tensor, space: str, vocab: int,
        temperature: float = 1.0) -> torch.Tensor:
    """The members' next-token distributions combined with ``weights`` (normalised over these members):
    probability space gives ``log sum_i w_i softmax(z_i)`` (log-probabilities: sampling acts on that
    mixture itself), logit space ``sum_i w_i z_i``. ``temperature`` < 1 sharpens the result."""
    z = torch.stack([x[:vocab].float() for x in logits])  # (M, V)
    # the members left may all have weight 0 (the others were dropped): then they count equally
    w = weights / weights.sum() if weights.sum() > 0 else torch.full_like(weights, 1 / len(weights))
    if space == "logit":
        out = (w[:, None] * z).sum(0)
    else:
        out = torch.log((w[:, None] * torch.softmax(z, dim=-1)).sum(0).clamp_min(1e-30))
    return out if temperature == 1.0 else out / temperature
