"""The ReasonFormer module: representation / skill-routed reasoning steps with a stop gate / coda over a
frozen Llama-architecture base; skill LoRAs, the router, the gate and the per-(layer, step) KV slots."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from chorus.engines.families.checkpoint import OverBaseModel, frozen_spans
from chorus.engines.families.reasonformer.config import ReasonFormerConfig
from chorus.engines.runtime.kv_cache import StepSlots, run_layers


class Pick:
    """Which LoRA entry each row uses in the block run under way, per bank; shared by every `SkillLoRA`
    (set once per run). An entry is an int (every row the same) or a (B,) tensor; None = bank off."""

    __slots__ = ("index",)

    def __init__(self) -> None:
        self.index: list[int | torch.Tensor | None] = []


class SkillLoRA(nn.Module):
    """A frozen linear plus banks of LoRA entries (A: (count, r, in), B: (count, out, r), B starts at zero).

    Shared modules use two banks (the skill's LoRA, then its step adapter); private modules one (the
    (skill, step) LoRA)."""

    base: nn.Linear
    pick: Pick  # a plain attribute, set through __dict__ (not a submodule)

    def __init__(self, base: nn.Linear, banks: list[tuple[int, int]], alpha: float, pick: Pick) -> None:
        super().__init__()
        self.base = base
        self.A = nn.ParameterList([nn.Parameter(torch.randn(n, r, base.in_features) / math.sqrt(base.in_features))
                                   for n, r in banks])
        self.B = nn.ParameterList([nn.Parameter(torch.zeros(n, base.out_features, r)) for n, r in banks])
        self.scales = [alpha / r for _, r in banks]
        self.__dict__["pick"] = pick

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, L, in)
        y = self.base(x)
        for a_bank, b_bank, scale, idx in zip(self.A, self.B, self.scales, self.pick.index):
            if idx is None:
                continue
            if isinstance(idx, int):
                d = (x @ a_bank[idx].t()) @ b_bank[idx].t()
            else:  # one entry per row
                a, b = a_bank.index_select(0, idx), b_bank.index_select(0, idx)  # (B, r, in), (B, out, r)
                d = torch.bmm(torch.bmm(x, a.transpose(1, 2)), b.transpose(1, 2))
            y = y + d * scale
        return y


def pool(h: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean over each row's valid tokens: (B, L, d), (B, L) -> (B, d). A row with none averages all."""
    w = torch.where(valid.any(1, keepdim=True), valid, torch.ones_like(valid)).to(h.dtype).unsqueeze(-1)
    return (h * w).sum(1) / w.sum(1)


class SkillRouter(nn.Module):
    """``S = softmax(FFN(pool(T(H))))``: T one small transformer layer over a down-projection of H."""

    def __init__(self, hidden: int, skills: int, dim: int, heads: int) -> None:
        super().__init__()
        self.down = nn.Linear(hidden, dim)
        self.layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=0.0, batch_first=True,
                                                norm_first=True)
        self.out = nn.Linear(dim, skills)
        self.ffn = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), self.out)
        nn.init.zeros_(self.out.weight)  # starts uniform over the skills
        nn.init.zeros_(self.out.bias)

    def forward(self, h: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:  # (B, L, hidden), (B, L) -> (B, n)
        seen = torch.where(valid.any(1, keepdim=True), valid, torch.ones_like(valid))
        z = self.layer(self.down(h), src_key_padding_mask=~seen)
        return torch.softmax(self.ffn(pool(z, seen)).float(), -1)


class StopGate(nn.Module):
    """``g = sigmoid(FFN(pool(state)))``: a step's scalar gate, read from the state the step would refine."""

    def __init__(self, hidden: int, dim: int, init_bias: float = -2.0) -> None:
        super().__init__()
        self.out = nn.Linear(dim, 1)
        self.ffn = nn.Sequential(nn.Linear(hidden, dim), nn.GELU(), self.out)
        nn.init.normal_(self.out.weight, std=0.01)
        nn.init.constant_(self.out.bias, init_bias)  # starts closed (0.12): a fresh retrofit stops after step 1

    def forward(self, h: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:  # -> (B,)
        return torch.sigmoid(self.ffn(pool(h, valid)).float()).squeeze(-1)


@dataclass
class Decision:
    """One sequence's reasoning, decided on its prompt and kept for its decoded tokens: per step run, the
    skills and their weights, the gate value (None at step 1, which always runs) and the step's
    coefficient (product of the gates so far); ``stop_gate`` is the gate that ended the cascade early."""

    skills: list[list[int]] = field(default_factory=list)
    weights: list[list[float]] = field(default_factory=list)
    gates: list[float | None] = field(default_factory=list)
    coefs: list[float] = field(default_factory=list)
    stop_gate: float | None = None

    @property
    def depth(self) -> int:
        return len(self.skills)


@dataclass
class RowControl:
    """What one row of a forward wants: its step cap and stop threshold, and its decision once made."""

    max_steps: int
    stop_threshold: float
    decision: Decision | None = None


@dataclass
class ReasonOutput:
    logits: torch.Tensor
    gate_probs: torch.Tensor | None = None  # (B, steps): each step's gate (1 at step 1), training's depth cost


class ReasonFormerModel(OverBaseModel):
    """Representation / skill-routed reasoning steps with a stop gate / coda over a Llama-architecture base."""

    family = "ReasonFormer"

    def __init__(self, base: Any, cfg: ReasonFormerConfig) -> None:
        super().__init__(base, cfg)
        self.cfg = cfg
        self.representation, self.block, self.coda = frozen_spans(base, cfg.representation, cfg.block, cfg.coda)
        h = base.config.hidden_size
        s, steps = cfg.n_skills, cfg.max_steps
        banks = [(s, cfg.rank), (s * steps, cfg.adapter_rank)] if cfg.kind == "shared" else [(s * steps, cfg.rank)]
        self.pick = Pick()
        self.loras: list[SkillLoRA] = []
        for layer in self.block:
            for t in cfg.targets:
                lora = SkillLoRA(getattr(layer.self_attn, t), banks, cfg.alpha, self.pick)
                setattr(layer.self_attn, t, lora)
                self.loras.append(lora)
        self.routers = nn.ModuleList(SkillRouter(h, s, cfg.router_dim, cfg.router_heads) for _ in range(steps))
        self.gates = nn.ModuleList(StopGate(h, cfg.router_dim) for _ in range(steps - 1))  # steps 2..max_steps
        #: per-row controls for the next forward (set by the engine); None: the config's defaults
        self.controls: list[RowControl | None] | None = None
        self.reports: list[Decision] = []

    # ---- parameters ----
    def trainable(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for i, lora in enumerate(self.loras):
            for k, (a, b) in enumerate(zip(lora.A, lora.B)):
                out[f"lora.{i}.A{k}"] = a
                out[f"lora.{i}.B{k}"] = b
        for name, p in self.routers.named_parameters():
            out[f"routers.{name}"] = p
        for name, p in self.gates.named_parameters():
            out[f"gates.{name}"] = p
        return out

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.trainable().items()}


    # ---- pieces ----
    def _set_pick(self, skill: torch.Tensor | int | None, step: int) -> None:
        """The LoRA entries for ``skill`` (an int, or (B,) one per row) at reasoning step ``step``."""
        if skill is None:
            self.pick.index = []
            return
        if isinstance(skill, torch.Tensor) and skill.shape[0] == 1:
            skill = int(skill[0])
        at_step = skill * self.cfg.max_steps + step
        self.pick.index = [skill, at_step] if self.cfg.kind == "shared" else [at_step]

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.base.lm_head(self.base.model.norm(x))

    def _route(self, step: int, state: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The k skills of every row and their weights renormalised to sum to 1: (B, k) each.

        When training, the weights carry a straight-through term ``p - p.detach()`` (value 0) of the chosen
        skills' unnormalised probabilities: renormalised top-1 weights are always 1 and would teach the
        router nothing; this way the router's gradient is Switch's (the update times d p_j)."""
        probs = self.routers[step](state, valid)  # (B, n)
        p, sel = probs.topk(self.cfg.k, -1)
        w = p / p.sum(-1, keepdim=True)
        if torch.is_grad_enabled():
            w = w.detach() + (p - p.detach())
        return sel, w

    # ---- forward ----
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: Any = None, use_cache: bool = False,
                logits_to_keep: int | torch.Tensor = 0, skill: int | torch.Tensor | None = None,
                max_steps: int | None = None, open_gates: bool = False, **_: Any) -> ReasonOutput:
        """input_ids (B, L); attention_mask: a 4-D boolean (B, 1, L, T+L) mask or None (causal).

        In training mode every step runs and the gate soft-stops (scales) later steps; in eval mode a
        row ends its cascade before a step whose gate is below its threshold. ``skill`` fixes the skill
        (stage-1 training: the router is not used); ``max_steps`` overrides every row's cap; ``open_gates``
        runs every step in full (stage-1 training: each step's adapters learn)."""
        cfg = self.cfg
        b, l = input_ids.shape
        dev = input_ids.device
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + l, device=dev).unsqueeze(0).expand(b, l)
        if attention_mask is None:
            causal = torch.ones(l, l, dtype=torch.bool, device=dev).tril()
            attention_mask = causal[None, None].expand(b, 1, l, l)
        valid = attention_mask[:, 0].diagonal(offset=attention_mask.shape[-1] - l, dim1=-2, dim2=-1)  # (B, L)
        controls = self.controls or [None] * b
        decided = [c.decision if c is not None else None for c in controls]
        caps = [max_steps or (c.max_steps if c is not None else cfg.max_steps) for c in controls]
        cap = torch.tensor([d.depth if d is not None else m for d, m in zip(decided, caps)], device=dev)  # (B,)
        thr = torch.tensor([c.stop_threshold if c is not None else cfg.stop_threshold for c in controls], device=dev)
        is_decided = torch.tensor([d is not None for d in decided], device=dev)
        live = valid.any(1)
        need = bool((live & ~is_decided).any())  # some row decides now (its prompt's first forward)
        steps_max = int(cap[live].max()) if bool(live.any()) else 1
        if skill is not None and cache is not None:
            raise ValueError("a fixed skill (stage-1 training) runs without a cache")
        k, blk = cfg.k if skill is None else 1, len(self.block)
        slots = StepSlots(cache, len(self.representation), len(self.coda), cfg.k * blk) if cache is not None else None
        if slots is not None:
            slots.ensure_steps(steps_max)

        x = self.base.model.embed_tokens(input_ids)  # (B, L, h)
        rope = self.base.model.rotary_emb(x, position_ids=position_ids)
        rep_slots = list(range(len(self.representation))) if slots else None
        state = run_layers(self.representation, x, rep_slots, slots, attention_mask, position_ids, rope)
        active = live.clone()
        ones = torch.ones(b, device=dev)
        coef = ones
        logs: dict[str, list[torch.Tensor]] = {"sel": [], "w": [], "gate": [], "coef": [], "run": []}
        for i in range(steps_max):
            # the gate: step 1 always runs; step i's update is scaled by the product of the gates so far
            g = self.gates[i - 1](state, valid) if i > 0 and need and not open_gates else ones
            coef = coef * g
            if bool(is_decided.any()):
                given = [d.coefs[i] if d is not None and i < d.depth else 1.0 for d in decided]
                coef = torch.where(is_decided, torch.tensor(given, device=dev), coef)
            logs["gate"].append(g)
            if not self.training and i > 0:
                active = active & (is_decided | (g >= thr))
            running = active & (cap > i)  # (B,)
            if not bool(running.any()):
                break
            sel, w = self._skills(i, state, valid, skill, decided, is_decided, need, k)
            mix: torch.Tensor | None = None
            first: torch.Tensor | None = None
            for q in range(sel.shape[1]):
                self._set_pick(sel[:, q], i)
                try:
                    blk_slots = [slots.core_slot(i, q * blk + j) for j in range(blk)] if slots else None
                    y = run_layers(self.block, state, blk_slots, slots, attention_mask, position_ids, rope)
                finally:
                    self._set_pick(None, i)
                # sum_q w_q y_q, written as y_0 + sum_{q>0} w_q (y_q - y_0) (the weights sum to 1): identical
                # skills give y_0 exactly
                if first is None or mix is None:
                    mix = first = y
                else:
                    mix = mix + w[:, q, None, None].to(y.dtype) * (y - first)
            assert mix is not None
            scale = coef
            if w.requires_grad:  # the straight-through term of `_route` (value 0): the router's gradient
                scale = coef * (1 + (w - w.detach()).sum(-1))
            new = torch.lerp(state, mix, scale[:, None, None].to(state.dtype))  # 1 gives mix exactly
            state = torch.where(running[:, None, None], new, state)
            for name, t in (("sel", sel), ("w", w), ("coef", coef), ("run", running)):
                logs[name].append(t)
            active = running
        if slots is not None:
            slots.pad_unwritten(max(0, len(logs["run"]) - 1), l)
        coda_slots = [len(self.representation) + j for j in range(len(self.coda))] if slots else None
        out = run_layers(self.coda, state, coda_slots, slots, attention_mask, position_ids, rope)
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            out = out[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            out = out.index_select(1, logits_to_keep)
        self.reports = self._decisions(decided, logs, cap.tolist())
        return ReasonOutput(self.head(out), torch.stack(logs["gate"], 1))

    def _skills(self, i: int, state: torch.Tensor, valid: torch.Tensor, skill: int | torch.Tensor | None,
                decided: list[Decision | None], is_decided: torch.Tensor, need: bool,
                k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step i's skills and weights per row, (B, k) each: fixed (stage 1), decided on the prompt, or routed."""
        b, dev = state.shape[0], state.device
        if skill is not None:
            sel = torch.full((b, 1), skill, device=dev) if isinstance(skill, int) else skill.view(b, 1)
            return sel, torch.ones(b, 1, device=dev)
        if need:
            sel, w = self._route(i, state, valid)
        else:
            sel = torch.arange(k, device=dev).expand(b, k)
            w = torch.full((b, k), 1.0 / k, device=dev)
        if bool(is_decided.any()):
            d_sel = torch.tensor([d.skills[i] if d is not None and i < d.depth else list(range(k)) for d in decided],
                                 device=dev)
            d_w = torch.tensor([d.weights[i] if d is not None and i < d.depth else [1.0 / k] * k for d in decided],
                               device=dev)
            sel = torch.where(is_decided[:, None], d_sel, sel)
            w = torch.where(is_decided[:, None], d_w.to(w.dtype), w)
        return sel, w

    def _decisions(self, decided: list[Decision | None], logs: dict[str, list[torch.Tensor]],
                   cap: list[int]) -> list[Decision]:
        """What each row did (a decided row: its decision, unchanged)."""
        sel, w, gates, coefs, runs = ([t.tolist() for t in logs[n]] for n in ("sel", "w", "gate", "coef", "run"))
        out = []
        for r, given in enumerate(decided):
            if given is not None:
                out.append(given)
                continue
            d = Decision()
            for i in range(len(gates)):
                if i >= len(runs) or not runs[i][r]:
                    if 0 < i < cap[r] and d.depth == i:  # its gate ended the cascade
                        d.stop_gate = round(gates[i][r], 6)
                    break
                d.skills.append(sel[i][r])
                d.weights.append(w[i][r])
                d.gates.append(round(gates[i][r], 6) if i > 0 else None)
                d.coefs.append(coefs[i][r])
            out.append(d)
        return out
