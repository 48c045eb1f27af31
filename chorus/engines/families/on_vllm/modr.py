"""MoDr on vLLM: chorus's forward (families/modr/model.py) on vLLM's layers and paged KV cache.

    e = prelude(embed(x)); s = e
    step t = 1..R:  h = adapter([s; e]);  r = sigmoid(mean over the sequence's tokens of router(h))
                    branch = argmax(r + bias), g = r[branch];  s = core_branch(h)   (LoRA delta scaled by g)
    out = norm(coda(s))

Each (core layer, step) has its own KV slot, as in chorus's engine. A prompt is routed once per step over its
tokens in the forward (all of it: the plugin runs without vLLM's prefix cache, and prompts up to vLLM's
``--max-num-batched-tokens`` prefill in one forward); a decoded token is routed on its own, as chorus does.
What vLLM cannot carry per request is served as the checkpoint says: the recurrence (``modr.recurrence`` in
config.json) for every request, no adaptive exit; chorus's gateway refuses ``recurrence`` / ``exit`` for a
remote model rather than ignore them."""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import VllmConfig

from chorus.engines.families.on_vllm.over_base import (
    Lora,
    LoRADelta,
    OverBaseForCausalLM,
    layer_forward,
    sequence_mean,
    sequences,
    stack_qkv,
)


class MoDrForCausalLM(OverBaseForCausalLM):
    family = "modr"
    what = "MoDr"

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        s = self.settings
        self.recurrence = int(s["recurrence"])
        self.targets: list[str] = list(s["targets"])
        self.branches, self.rank = int(s["branches"]), int(s["rank"])
        self.scale = float(s["alpha"]) / self.rank
        # step 0 uses the core layers' own KV slots; steps 1..R-1 one slot per (step, core layer)
        core = self.span("core")
        self.step_slots = [[None] * len(core)] + [
            [self.new_slot(self.model.layers[i].self_attn) for i in core] for _ in range(1, self.recurrence)]
        self.loras: list[tuple[LoRADelta | None, LoRADelta | None]] = []
        self.adapter = self.router = self.router_bias = torch.empty(0)

    def load_own(self, tensors: dict[str, torch.Tensor]) -> None:
        ref = self.model.embed_tokens.weight
        get = lambda name: tensors[name].to(device=ref.device, dtype=ref.dtype)  # noqa: E731
        self.adapter, self.router = get("adapter.weight"), get("router.weight")
        self.router_bias = tensors["router.bias"].to(device=ref.device, dtype=ref.dtype)
        self.loras = []
        n_t = len(self.targets)
        for j, i in enumerate(self.span("core")):
            sa: Any = self.model.layers[i].self_attn
            lora = {t: (get(f"lora.{j * n_t + k}.A"), get(f"lora.{j * n_t + k}.B"))
                    for k, t in enumerate(self.targets)}
            qkv = None
            if any(t in lora for t in ("q_proj", "k_proj", "v_proj")):
                qkv = stack_qkv([lora.get(t) for t in ("q_proj", "k_proj", "v_proj")],
                                (sa.q_size, sa.kv_size, sa.kv_size), self.rank, self.branches, ref.shape[1])
                qkv.a, qkv.b = qkv.a.to(ref.device), qkv.b.to(ref.device)
            o = LoRADelta(*lora["o_proj"]) if "o_proj" in lora else None
            self.loras.append((qkv, o))

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors: Any = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = inputs_embeds if inputs_embeds is not None else self.model.embed_input_ids(input_ids)
        e = self.run(self.span("prelude"), positions, x)
        seg, n_seq = sequences(e.shape[0], e.device)
        s = e
        core = self.span("core")
        for t in range(self.recurrence):
            h = torch.nn.functional.linear(torch.cat([s, e], -1), self.adapter)
            r = torch.sigmoid(sequence_mean(torch.nn.functional.linear(h, self.router), seg, n_seq))  # (S, N)
            branch = torch.argmax(r + self.router_bias, -1)  # (S,)
            gate = r.gather(1, branch[:, None]).squeeze(1)
            pick, scale = branch[seg], gate[seg] * self.scale  # per token
            y = h
            for j, i in enumerate(core):
                qkv, o = self.loras[j]
                y = layer_forward(self.model.layers[i], positions, y, self.step_slots[t][j],
                                  [Lora(qkv, o, pick, scale)])
            s = y
        return self.finish(self.run(self.span("coda"), positions, s))
