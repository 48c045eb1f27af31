"""The trainable MoE layer: one router of `moe_routing` over the experts of a transformers MoE block.

`MoELayer.wrap` takes the block a Mixtral, Qwen2-MoE or DeepSeek-V3-layout model (DeepSeek-V3 /
GLM-4-MoE classes) already holds and uses *its* tensors (router weight, stacked expert weights,
shared experts, the DeepSeek selection bias): training moves them in place, and putting the block
back (`unwrap_all`) leaves a model that ``save_pretrained`` writes in the hub layout, which
transformers, vLLM and ``chorus serve`` load unchanged. In evaluation mode the layer's output
equals the block's own forward on the same weights (tests/unit/test_moe_training.py, per layout).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from chorus.engines.families.moe import is_moe_block
from chorus.engines.families.moe_routing import GATES, LayoutRule, Router, Routing
from chorus.errors import BuildError


class MoELayer(nn.Module):
    """Routed experts (+ shared experts) with dispatch by index: each expert runs on its own tokens only."""

    def __init__(self, block: Any, router: Router) -> None:
        super().__init__()
        self.router = router
        self.experts = block.experts  # gate_up_proj (E, 2I, h), down_proj (E, h, I), act_fn
        # Qwen2-MoE: a gated shared expert; DeepSeek-V3: ungated shared experts; Mixtral: none
        self.shared = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)
        self.shared_gate = getattr(block, "shared_expert_gate", None)
        self.__dict__["block"] = block  # not a submodule: its tensors are already ours through the ones above
        self.last: Routing | None = None

    @classmethod
    def wrap(cls, block: Any, config: Any, kind: str, **settings: Any) -> MoELayer:
        if kind not in GATES:
            raise BuildError(f"unknown router {kind!r} (expected one of {', '.join(GATES)})")
        rule = LayoutRule.of(config)
        gate = block.gate
        if kind == "deepseek":
            settings = {**settings, "bias": getattr(gate, "e_score_correction_bias", None)}
        router = GATES[kind](gate.weight, rule, **settings)
        return cls(block, router)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        routing = self.router(x)
        self.last = routing
        out = torch.zeros_like(x)
        idx, weights = routing.experts, routing.weights
        ex: Any = self.experts
        # one unbind per tensor, not an index per expert: backward then builds the stacked gradient once
        # instead of a zero-filled (E, ...) tensor for every expert it visits
        gate_up, down = ex.gate_up_proj.unbind(0), ex.down_proj.unbind(0)
        for e in torch.unique(idx[idx >= 0]).tolist():
            token, slot = torch.where(idx == e)
            gate, up = nn.functional.linear(x[token], gate_up[e]).chunk(2, dim=-1)
            y = nn.functional.linear(ex.act_fn(gate) * up, down[e])
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        if self.shared is not None:
            s = self.shared(x)
            if self.shared_gate is not None:
                s = torch.sigmoid(self.shared_gate(x)) * s
            out = out + s
        return out.reshape(shape)


def decoder_blocks(model: Any) -> list[Any]:
    """The decoder layers whose ``mlp`` is an MoE block (a router ``gate`` and ``experts``)."""
    layers = [layer for layer in model.model.layers if is_moe_block(layer.mlp)]
    if not layers:
        raise BuildError("the model has no MoE blocks to train")
    return layers


def wrap_all(model: Any, kind: str, **settings: Any) -> list[MoELayer]:
    cfg = model.config
    wrapped = []
    for layer in decoder_blocks(model):
        moe = MoELayer.wrap(layer.mlp, cfg, kind, **settings)
        layer.mlp = moe
        wrapped.append(moe)
    return wrapped


def unwrap_all(model: Any) -> None:
    for layer in model.model.layers:
        if isinstance(layer.mlp, MoELayer):
            layer.mlp = layer.mlp.block
