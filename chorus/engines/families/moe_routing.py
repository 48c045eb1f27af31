"""The routers of the MoE papers chorus trains with (docs/methods.md §6): Switch, GShard and DeepSeek.

A router turns a layer's router logits into a `Routing`: which experts each token goes to and the
weight each expert's output gets. In evaluation mode (serving) every router computes exactly what
the checkpoint layout's own MoE block computes, so a trained model is served unchanged:

- ``mixtral``: softmax over the logits, top-k, the k weights renormalised to sum to 1.
- ``qwen2_moe``: softmax, top-k, renormalised only when the config says ``norm_topk_prob``.
- ``deepseek_v3``: sigmoid scores; experts are *selected* on score + ``e_score_correction_bias``
  (within the best ``topk_group`` of ``n_group`` groups) but *weighted* by the plain scores,
  normalised when ``norm_topk_prob``, times ``routed_scaling_factor``.

Training adds what each paper adds on top (only while ``training``):

- `SwitchRouter` (top-1): a capacity of ``ceil(capacity_factor * tokens / experts)`` per expert
  (tokens past it are dropped: the layer adds nothing for them and the residual carries them),
  the Switch auxiliary loss, the router z-loss, optional multiplicative jitter on the router input.
  On a layout that renormalises, a top-1 weight is always 1 and would give the router no gradient:
  the weight is then ``p / stop_gradient(p)`` (value 1, the gradient of ``p``).
- `GShardRouter` (top-2): capacity per expert filled by first choices before second choices, the
  second expert dispatched only with probability ``min(1, 2 * g2)`` (g2: its normalised weight), the
  auxiliary loss on first choices.
- `DeepSeekRouter`: no capacity and no loss term by default; the selection bias
  (``e_score_correction_bias``) moves by `BiasBalancer` after each step (auxiliary-loss-free).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from chorus.engines.families.balance import BiasBalancer, counts_of, router_z_loss, switch_aux_loss
from chorus.errors import BuildError

LAYOUTS = ("mixtral", "qwen2_moe", "deepseek_v3")


@dataclass
class Routing:
    experts: torch.Tensor  # (T, k) long; -1 where a decision was dropped (capacity) or not dispatched
    weights: torch.Tensor  # (T, k) float; 0 where dropped
    aux: torch.Tensor  # scalar: the weighted loss terms this router adds (0 at inference)
    counts: torch.Tensor  # (E,) decisions per expert before capacity
    dropped: int  # decisions dropped by capacity


@dataclass(frozen=True)
class LayoutRule:
    """How a checkpoint layout turns logits into weights (what its transformers block computes)."""

    layout: str
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1

    @classmethod
    def of(cls, config: Any) -> LayoutRule:
        kind = getattr(config, "model_type", "")
        if kind == "mixtral":
            return cls("mixtral")
        if kind == "qwen2_moe":
            return cls("qwen2_moe", bool(config.norm_topk_prob))
        if kind in ("deepseek_v3", "glm4_moe"):
            return cls("deepseek_v3", bool(config.norm_topk_prob), float(config.routed_scaling_factor),
                       int(config.n_group), int(config.topk_group))
        raise BuildError(f"{kind!r} is not an MoE layout chorus trains (expected one of mixtral, qwen2_moe, "
                         "deepseek_v3 / glm4_moe)")


class Router(nn.Module):
    """The shared part: a linear router (E, hidden) and the layout's inference rule."""

    kind: ClassVar[str] = ""
    layouts: ClassVar[tuple[str, ...]] = LAYOUTS
    bias: torch.Tensor | None

    def __init__(self, weight: nn.Parameter, top_k: int, rule: LayoutRule, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if rule.layout not in self.layouts:
            raise BuildError(f"the {self.kind} router does not fit the {rule.layout} layout (it fits "
                             f"{', '.join(self.layouts)})")
        experts = weight.shape[0]
        if not 1 <= top_k <= experts:
            raise BuildError(f"top-k must be between 1 and the {experts} experts (got {top_k})")
        self.weight = weight
        self.top_k = top_k
        self.rule = rule
        self.bias = bias

    @property
    def experts(self) -> int:
        return int(self.weight.shape[0])

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.rule.layout == "deepseek_v3":
            return nn.functional.linear(x.float(), self.weight.float())
        return nn.functional.linear(x, self.weight)

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        if self.rule.layout == "deepseek_v3":
            return logits.sigmoid()
        return torch.softmax(logits.float(), dim=-1)

    def select(self, scores: torch.Tensor) -> torch.Tensor:
        """(T, E) scores -> (T, k) expert indices, as the layout selects them."""
        if self.rule.layout != "deepseek_v3":
            return torch.topk(scores, self.top_k, dim=-1).indices
        choice = scores if self.bias is None else scores + self.bias
        r = self.rule
        if r.n_group > 1:
            groups = choice.view(-1, r.n_group, self.experts // r.n_group).topk(2, dim=-1)[0].sum(-1)
            keep = torch.zeros_like(groups).scatter_(1, torch.topk(groups, r.topk_group, dim=-1, sorted=False)[1], 1)
            mask = keep.unsqueeze(-1).expand(-1, r.n_group, self.experts // r.n_group).reshape(-1, self.experts)
            choice = choice.masked_fill(~mask.bool(), float("-inf"))
        return torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]

    def weigh(self, scores: torch.Tensor, idx: torch.Tensor, logits_dtype: torch.dtype) -> torch.Tensor:
        w = scores.gather(1, idx)
        r = self.rule
        if r.layout == "deepseek_v3":
            if r.norm_topk_prob:
                w = w / (w.sum(-1, keepdim=True) + 1e-20)
            return w * r.routed_scaling_factor
        if r.layout == "mixtral" or r.norm_topk_prob:
            if self.top_k == 1 and self.training:
                return w / w.detach()  # value 1 as served, the gradient of p for the router
            w = w / w.sum(-1, keepdim=True)
        return w if r.layout == "mixtral" else w.to(logits_dtype)

    def forward(self, x: torch.Tensor) -> Routing:
        """x: (T, hidden) -> the routing of every token."""
        logits = self.logits(self.jitter(x))
        scores = self.scores(logits)
        idx = self.select(scores)
        weights = self.weigh(scores, idx, logits.dtype)
        counts = counts_of(idx, self.experts)
        if not self.training:
            return Routing(idx, weights, logits.new_zeros(()), counts, 0)
        return self.train_routing(logits, scores, idx, weights, counts)

    def jitter(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def train_routing(self, logits: torch.Tensor, scores: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                      counts: torch.Tensor) -> Routing:
        return Routing(idx, weights, logits.new_zeros(()), counts, 0)

    def step_end(self) -> None:
        """Called by the trainer after each optimiser step."""


def capacity_limit(idx: torch.Tensor, weights: torch.Tensor, experts: int, capacity: int) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor, int]:
    """Keep at most ``capacity`` decisions per expert, filling by choice rank (all first choices, then second
    choices), tokens in order within a rank. Dropped decisions get expert -1 and weight 0."""
    idx, weights = idx.clone(), weights.clone()
    used = torch.zeros(experts, dtype=torch.long, device=idx.device)
    dropped = 0
    for rank in range(idx.shape[1]):
        col = idx[:, rank]
        live = col >= 0
        onehot = nn.functional.one_hot(col.clamp(min=0), experts) * live[:, None]
        position = (onehot.cumsum(0) - 1 + used) * onehot  # this decision's slot in its expert
        slot = position.sum(1)
        over = live & (slot >= capacity)
        dropped += int(over.sum())
        idx[over, rank] = -1
        weights[:, rank] = weights[:, rank].masked_fill(over, 0.0)
        used += onehot.sum(0)
    return idx, weights, dropped


class SwitchRouter(Router):
    """Switch Transformer routing: top-1, capacity, auxiliary balance loss, router z-loss, jitter."""

    kind = "switch"
    layouts = ("mixtral", "qwen2_moe")

    def __init__(self, weight: nn.Parameter, rule: LayoutRule, *, capacity_factor: float = 1.25,
                 aux_weight: float = 0.01, z_weight: float = 0.001, jitter: float = 0.0, **_: Any) -> None:
        super().__init__(weight, 1, rule)
        check_settings(capacity_factor, aux_weight, z_weight, jitter)
        self.capacity_factor, self.aux_weight, self.z_weight, self.jitter_eps = (
            capacity_factor,
            aux_weight,
            z_weight,
            jitter,
        )

    @classmethod
    def tiny(cls, hidden: int = 16, experts: int = 4) -> SwitchRouter:
        return cls(nn.Parameter(torch.randn(experts, hidden) * 0.1), LayoutRule("mixtral"))

    def jitter(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.jitter_eps == 0:
            return x
        return x * torch.empty_like(x).uniform_(1 - self.jitter_eps, 1 + self.jitter_eps)

    def train_routing(self, logits: torch.Tensor, scores: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                      counts: torch.Tensor) -> Routing:
        aux = self.aux_weight * switch_aux_loss(scores, nn.functional.one_hot(idx[:, 0], self.experts))
        aux = aux + self.z_weight * router_z_loss(logits)
        capacity = capacity_of(self.capacity_factor, idx.shape[0] * idx.shape[1], self.experts)
        idx, weights, dropped = capacity_limit(idx, weights, self.experts, capacity)
        return Routing(idx, weights, aux, counts, dropped)


class GShardRouter(Router):
    """GShard routing: top-2, capacity per expert, random dispatch of the second expert, auxiliary loss."""

    kind = "gshard"
    layouts = ("mixtral", "qwen2_moe")

    def __init__(self, weight: nn.Parameter, rule: LayoutRule, *, capacity_factor: float = 1.25,
                 aux_weight: float = 0.01, z_weight: float = 0.0, generator: torch.Generator | None = None,
                 **_: Any) -> None:
        super().__init__(weight, 2, rule)
        check_settings(capacity_factor, aux_weight, z_weight, 0.0)
        self.capacity_factor, self.aux_weight, self.z_weight = capacity_factor, aux_weight, z_weight
        self.generator = generator

    @classmethod
    def tiny(cls, hidden: int = 16, experts: int = 4) -> GShardRouter:
        return cls(nn.Parameter(torch.randn(experts, hidden) * 0.1), LayoutRule("mixtral"))

    def train_routing(self, logits: torch.Tensor, scores: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                      counts: torch.Tensor) -> Routing:
        aux = self.aux_weight * switch_aux_loss(scores, nn.functional.one_hot(idx[:, 0], self.experts))
        if self.z_weight:
            aux = aux + self.z_weight * router_z_loss(logits)
        g2 = (scores.gather(1, idx[:, 1:2]) / scores.gather(1, idx).sum(-1, keepdim=True)).squeeze(1).detach()
        u = torch.rand(g2.shape, generator=self.generator, device="cpu").to(g2.device)
        skip = ~(2 * g2 > u)  # the second expert is dispatched with probability min(1, 2 * g2)
        idx = idx.clone()
        idx[skip, 1] = -1
        weights = torch.stack([weights[:, 0], weights[:, 1].masked_fill(skip, 0.0)], 1)
        capacity = capacity_of(self.capacity_factor, idx.shape[0] * 2, self.experts)
        idx, weights, dropped = capacity_limit(idx, weights, self.experts, capacity)
        return Routing(idx, weights, aux, counts, dropped)


class DeepSeekRouter(Router):
    """DeepSeek-V3 routing: sigmoid gate, top-k over fine-grained experts (next to always-on shared experts),
    auxiliary-loss-free balancing through the selection bias; an optional sequence-free auxiliary loss
    (``aux_weight``, 0 by default) for comparison."""

    kind = "deepseek"
    layouts = ("deepseek_v3",)

    def __init__(self, weight: nn.Parameter, rule: LayoutRule, *, top_k: int = 2, bias: torch.Tensor | None = None,
                 bias_speed: float = 0.001, aux_weight: float = 0.0, **_: Any) -> None:
        bias = torch.zeros(weight.shape[0]) if bias is None else bias
        super().__init__(weight, top_k, rule, bias)
        check_settings(1.0, aux_weight, 0.0, 0.0)
        self.aux_weight = aux_weight
        self.balancer = BiasBalancer(bias, bias_speed)
        self._pending = torch.zeros(self.experts, dtype=torch.long)

    @classmethod
    def tiny(cls, hidden: int = 16, experts: int = 8) -> DeepSeekRouter:
        return cls(nn.Parameter(torch.randn(experts, hidden) * 0.1), LayoutRule("deepseek_v3"), top_k=2)

    def train_routing(self, logits: torch.Tensor, scores: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                      counts: torch.Tensor) -> Routing:
        self._pending += counts.cpu()
        aux = logits.new_zeros(())
        if self.aux_weight:
            probs = scores / scores.sum(-1, keepdim=True)
            chosen = torch.zeros_like(scores).scatter_(1, idx, 1.0)
            aux = self.aux_weight * switch_aux_loss(probs, chosen)
        return Routing(idx, weights, aux, counts, 0)

    def step_end(self) -> None:
        self.balancer.update(self._pending)
        self._pending.zero_()


GATES: dict[str, Callable[..., Router]] = {"switch": SwitchRouter, "gshard": GShardRouter, "deepseek": DeepSeekRouter}
#: the layout a dense base is upcycled into for each router
DEFAULT_LAYOUT = {"switch": "mixtral", "gshard": "mixtral", "deepseek": "deepseek_v3"}


def capacity_of(factor: float, decisions: int, experts: int) -> int:
    return max(1, math.ceil(factor * decisions / experts))


def check_settings(capacity_factor: float, aux_weight: float, z_weight: float, jitter: float) -> None:
    if not capacity_factor > 0:
        raise BuildError(f"--capacity must be > 0 (got {capacity_factor})")
    if aux_weight < 0 or z_weight < 0:
        raise BuildError("--aux-weight and --z-weight must be >= 0")
    if not 0 <= jitter < 1:
        raise BuildError(f"--jitter must be in [0, 1) (got {jitter})")
