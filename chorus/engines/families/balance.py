"""Load balancing for routed layers, shared by the MoE trainer and MoDr's branch router (docs/methods.md §6, §8).

- `switch_aux_loss`: the Switch Transformer auxiliary loss ``E * sum_i f_i * P_i`` (f_i: share of
  routing decisions sent to expert i, P_i: mean router probability of expert i). It is 1 when the
  load is even and grows to E when one expert takes everything; GShard's loss is the same form.
- `router_z_loss`: ``mean(logsumexp(logits)^2)`` (ST-MoE), keeps router logits small.
- `BiasBalancer`: DeepSeek-V3's auxiliary-loss-free balancing. A per-expert bias is added to the
  selection scores only (never to the weight an expert's output gets); after each step it moves
  ``b_i += speed * sign(mean(c) - c_i)`` with ``c_i`` the decisions that went to expert i. No loss
  term, so the language-model gradient is untouched.
- `load_stats`: what the evidence tables report: coefficient of variation of the loads and max/min.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def switch_aux_loss(probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """probs: (T, E) router probabilities; chosen: (T, E) 0/1 (or counts) of the decisions per token."""
    experts = probs.shape[-1]
    f = chosen.float().sum(0) / chosen.float().sum().clamp(min=1)
    p = probs.float().mean(0)
    return experts * (f * p).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def counts_of(indices: torch.Tensor, experts: int) -> torch.Tensor:
    """(...,) expert indices (negative: none) -> (E,) long counts."""
    flat = indices.reshape(-1)
    return torch.bincount(flat[flat >= 0], minlength=experts)[:experts]


class BiasBalancer:
    """Auxiliary-loss-free balancing over a bias tensor the router adds to its selection scores.

    ``bias`` is the router's own tensor (a buffer), updated in place, so a checkpoint stores it
    where the layout keeps it (``e_score_correction_bias`` in DeepSeek-V3, ``router.bias`` in MoDr).
    """

    def __init__(self, bias: torch.Tensor, speed: float) -> None:
        if speed < 0 or not math.isfinite(speed):
            raise ValueError(f"bias update speed must be a finite number >= 0 (got {speed})")
        self.bias = bias
        self.speed = speed

    @torch.no_grad()
    def update(self, counts: torch.Tensor) -> None:
        """counts: (E,) decisions per expert since the last update."""
        c = counts.to(self.bias.device, torch.float32)
        if self.speed == 0 or float(c.sum()) == 0:
            return
        self.bias += (self.speed * torch.sign(c.mean() - c)).to(self.bias.dtype)


def load_stats(counts: torch.Tensor | list[int] | list[list[int]]) -> dict[str, Any]:
    """Balance of (E,) or (layers, E) decision counts: coefficient of variation (std / mean, 0 = even) and
    max / min (inf when an expert got nothing), averaged over layers, plus the counts summed over layers."""
    c = torch.as_tensor(counts, dtype=torch.float64)
    if c.dim() == 1:
        c = c[None]
    mean = c.mean(1)
    cv = (c.std(1, unbiased=False) / mean.clamp(min=1e-12)).mean()
    lo, hi = c.min(1).values, c.max(1).values
    ratio = float("inf") if bool((lo == 0).any()) else float((hi / lo).mean())
    return {"cv": round(float(cv), 4), "max_min": round(ratio, 3) if math.isfinite(ratio) else ratio,
            "per_expert": [int(x) for x in c.sum(0).tolist()]}
