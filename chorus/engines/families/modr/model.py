"""The MoDr module: prelude / routed recurrent core / coda over a frozen base, LoRA branches, per-step KV slots."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from chorus.engines.families.balance import BiasBalancer, counts_of
from chorus.engines.families.checkpoint import OverBaseModel, frozen_spans
from chorus.engines.families.modr.config import MoDrConfig
from chorus.engines.runtime.kv_cache import StepSlots, run_layers


class Route:
    """The routing decision of the current recurrence step, shared by every LoRA of the core (one object,
    set once per step: cheaper than setting attributes on 72 modules).

    ``branch`` (B,) or (B, L) and ``gate`` alike; None = the plain core. ``uniform`` = (branch, gate)
    when every row uses the same branch (always at batch 1): gate a float, or (B,) when rows differ.
    """

    __slots__ = ("branch", "gate", "uniform")

    def __init__(self) -> None:
        self.branch: torch.Tensor | None = None
        self.gate: torch.Tensor | None = None
        self.uniform: tuple[int, float | torch.Tensor] | None = None


class BranchLoRA(nn.Module):
    """A frozen linear plus N LoRA branches (A: (N, r, in), B: (N, out, r), B starts at zero)."""

    base: nn.Linear
    # plain attributes, set through __dict__ (not submodules: no recursion through state_dict / .to())
    route: Route
    followers: list[BranchLoRA]
    leader: BranchLoRA | None
    shared: tuple[torch.Tensor, list[torch.Tensor]] | None  # (input, the followers' outputs) of the last call
    fused: dict[int | str, Any]  # branch k -> (A^T, B^T); "w" -> the stacked frozen q/k/v weight

    def __init__(self, base: nn.Linear, branches: int, rank: int, alpha: float, route: Route) -> None:
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        self.A = nn.Parameter(torch.randn(branches, rank, base.in_features) / math.sqrt(base.in_features))
        self.B = nn.Parameter(torch.zeros(branches, base.out_features, rank))  # zero: fresh branches add nothing
        # plain attributes (not submodules): the shared route, and q_proj leading k_proj / v_proj (same input),
        # which lets q_proj compute all three deltas in two matmuls
        self.__dict__.update(route=route, followers=[], leader=None, shared=None, fused={})

    def clear_fused(self) -> None:
        self.fused.clear()

    def _fused_weights(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Branch k as pre-transposed A^T (in, R) and B^T (R, out); for a q_proj leading k_proj and v_proj,
        the three side by side (R = 3r) with a block-diagonal B (out = out_q + out_k + out_v). Cached until
        the model is put in train/eval mode or loads weights."""
        got = self.fused.get(k)
        if got is None:
            group = [self, *self.followers]
            got = (torch.cat([m.A[k] for m in group]).t().contiguous(),
                   torch.block_diag(*[m.B[k] for m in group]).t().contiguous())
            self.fused[k] = got
        return got

    def _fused_base(self) -> torch.Tensor:
        """q, k and v's frozen weights stacked (out_q + out_k + out_v, in): one matmul for all three."""
        w = self.fused.get("w")
        if w is None:
            w = self.fused["w"] = torch.cat([m.base.weight for m in (self, *self.followers)]).contiguous()
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, L, in)
        route = self.route
        if self.leader is not None:
            shared = self.leader.shared
            if shared is not None and shared[0] is x:  # the leader computed this projection with its own
                return shared[1].pop(0)
        fuse = bool(self.followers) and not torch.is_grad_enabled() and self.base.bias is None
        if route.branch is not None and (route.uniform is None or (self.followers and not fuse)):
            return self._mixed(x, self.base(x), route)  # rows on different branches, or training
        if fuse:  # inference: q, k, v (and their deltas) in one go, k and v handed to the followers
            y = torch.nn.functional.linear(x, self._fused_base())  # (B, L, out_q + out_k + out_v)
        else:
            y = self.base(x)
        if route.branch is not None:
            # every row on one branch (batch 1 always): two small matmuls on pre-transposed weights
            k, g = route.uniform  # type: ignore[misc]
            at, bt = self._fused_weights(k)
            xa = x.reshape(-1, x.shape[-1]).mm(at)  # (B*L, R)
            if isinstance(g, torch.Tensor):  # rows share the branch but not the gate
                xa.mul_(g.to(xa.dtype).repeat_interleave(x.shape[1])[:, None])
                g = 1.0
            y.view(-1, y.shape[-1]).addmm_(xa, bt, alpha=self.scale * g)  # in place: y is our own output
        if not fuse:
            return y
        sizes = [m.base.out_features for m in (self, *self.followers)]
        parts = list(y.split(sizes, -1))
        self.shared = (x, parts[1:])
        return parts[0]

    def _mixed(self, x: torch.Tensor, y: torch.Tensor, route: Route) -> torch.Tensor:
        branch, gate = route.branch, route.gate
        assert branch is not None and gate is not None
        if branch.dim() == 1:  # one branch per row
            a = self.A.index_select(0, branch)  # (B, r, in)
            b = self.B.index_select(0, branch)  # (B, out, r)
            d = torch.bmm(torch.bmm(x, a.transpose(1, 2)), b.transpose(1, 2))  # (B, L, out)
            g = gate[:, None, None]
        else:  # one branch per token (reference path of the tests)
            a, b = self.A[branch], self.B[branch]  # (B, L, r, in), (B, L, out, r)
            d = torch.einsum("blor,blr->blo", b, torch.einsum("blri,bli->blr", a, x))
            g = gate[..., None]
        return y + d * (self.scale * g).to(d.dtype)


@dataclass
class RowControl:
    """What one row of a forward wants: its recurrence count and exit threshold (None = no exit)."""

    recurrence: int
    exit_kl: float | None = None


@dataclass
class RowReport:
    """What one row's last forward did: the branch per executed step, and the steps used."""

    branches: list[int] = field(default_factory=list)
    steps: int = 0


@dataclass
class MoDrOutput:
    logits: torch.Tensor


class MoDrModel(OverBaseModel):
    """Prelude / recurrent core with routed LoRA branches / coda over a Llama-architecture base."""

    family = "MoDr"

    router_bias: torch.Tensor  # (N,) buffer: balancing bias, selection only

    def __init__(self, base: Any, cfg: MoDrConfig) -> None:
        super().__init__(base, cfg)
        self.cfg = cfg
        self.prelude, self.core, self.coda = frozen_spans(base, cfg.prelude, cfg.core, cfg.coda)
        h = base.config.hidden_size
        self.adapter = nn.Linear(2 * h, h, bias=False)  # over [s; e]
        with torch.no_grad():
            eye = torch.eye(h)
            self.adapter.weight.copy_(torch.cat([eye * 0.5, eye * 0.5], 1))
        self.router = nn.Linear(h, cfg.branches, bias=False)
        nn.init.normal_(self.router.weight, std=0.02)
        self.register_buffer("router_bias", torch.zeros(cfg.branches))
        self.loras: list[BranchLoRA] = []
        self.route_state = Route()
        for layer in self.core:
            made = {}
            for t in cfg.targets:
                lora = BranchLoRA(getattr(layer.self_attn, t), cfg.branches, cfg.rank, cfg.alpha, self.route_state)
                setattr(layer.self_attn, t, lora)
                self.loras.append(lora)
                made[t] = lora
            if all(t in made for t in ("q_proj", "k_proj", "v_proj")):
                made["q_proj"].followers.extend([made["k_proj"], made["v_proj"]])
                made["k_proj"].__dict__["leader"] = made["v_proj"].__dict__["leader"] = made["q_proj"]
        #: per-row controls for the next forward (set by the engine); None: every row uses cfg.recurrence
        self.controls: list[RowControl | None] | None = None
        self.reports: list[RowReport] = []
        self.use_branches = True
        #: set by the trainer: the auxiliary-loss-free bias update, applied after each recurrence step's routing
        self.balancer: BiasBalancer | None = None

    # ---- parameters ----
    def branch_parameters(self) -> dict[str, torch.Tensor]:
        out = {"adapter.weight": self.adapter.weight, "router.weight": self.router.weight}
        for i, lora in enumerate(self.loras):
            out[f"lora.{i}.A"] = lora.A
            out[f"lora.{i}.B"] = lora.B
        return out

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {**{k: v.detach() for k, v in self.branch_parameters().items()}, "router.bias": self.router_bias}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        for lora in self.loras:
            lora.clear_fused()
        super().load_state_tensors(tensors)

    # ---- pieces ----
    def _set_route(self, branch: torch.Tensor | None, gate: torch.Tensor | None) -> None:
        route = self.route_state
        route.branch, route.gate, route.uniform = branch, gate, None
        if branch is None or gate is None or branch.dim() != 1 or torch.is_grad_enabled():
            return  # the per-row / per-token path (training keeps the gate's gradient)
        if branch.shape[0] == 1:
            route.uniform = (int(branch[0]), float(gate[0]))
        else:
            first = int(branch[0])
            if bool((branch == first).all()):
                route.uniform = (first, gate)

    def train(self, mode: bool = True) -> MoDrModel:
        for lora in self.loras:  # the weights may change from here on: drop the fused inference copies
            lora.clear_fused()
        return super().train(mode)

    def route(self, h: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h: (B, L, h), valid: (B, L) -> branch (B,), gate (B,), r (B, N): one decision per row."""
        u = self.router(h)  # (B, L, N)
        w = valid.to(u.dtype).unsqueeze(-1)  # (B, L, 1)
        mean = (u * w).sum(1) / w.sum(1).clamp(min=1)  # (B, N)
        r = torch.sigmoid(mean)
        branch = torch.argmax(r + self.router_bias, dim=-1)  # (B,)
        gate = r.gather(1, branch[:, None]).squeeze(1)  # (B,)
        return branch, gate, r

    def _run(self, layers: nn.ModuleList, x: torch.Tensor, slots: list[int] | None, cache: StepSlots | None,
             mask: torch.Tensor | None, pos: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return run_layers(layers, x, slots, cache, mask, pos, rope)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.base.lm_head(self.base.model.norm(x))

    # ---- forward ----
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: Any = None, use_cache: bool = False,
                logits_to_keep: int | torch.Tensor = 0, recurrence: int | None = None,
                route_per_token: bool = False, grad_steps: int | None = None, **_: Any) -> MoDrOutput:
        """input_ids (B, L); attention_mask: a 4-D boolean (B, 1, L, T+L) mask or None (causal);
        ``recurrence`` overrides the per-row controls for every row; ``route_per_token`` routes each
        token on its own (what decoding does token by token; the equivalence tests use it);
        ``grad_steps`` (training) keeps gradients for the last k recurrence steps only."""
        cfg = self.cfg
        b, l = input_ids.shape
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + l, device=input_ids.device).unsqueeze(0).expand(b, l)
        if attention_mask is None:
            causal = torch.ones(l, l, dtype=torch.bool, device=input_ids.device).tril()
            attention_mask = causal[None, None].expand(b, 1, l, l)
        valid = attention_mask[:, 0].diagonal(offset=attention_mask.shape[-1] - l, dim1=-2, dim2=-1)  # (B, L)
        controls = self.controls or [None] * b
        wanted = [recurrence or (c.recurrence if c else cfg.recurrence) for c in controls]
        rec = torch.tensor(wanted, device=input_ids.device)  # (B,)
        exit_kl = torch.tensor([c.exit_kl if (c and c.exit_kl is not None and l == 1) else -1.0 for c in controls],
                               device=input_ids.device)  # (B,), -1 = off
        steps_max = int(rec[valid.any(1)].max()) if bool(valid.any()) else 1
        share = cfg.kv_share
        slots = StepSlots(cache, len(self.prelude), len(self.coda), len(self.core)) if cache is not None else None
        if slots is not None:
            slots.ensure_steps(min(steps_max, share) if share else steps_max)

        x = self.base.model.embed_tokens(input_ids)  # (B, L, h)
        rope = self.base.model.rotary_emb(x, position_ids=position_ids)
        e = self._run(self.prelude, x, list(range(len(self.prelude))) if slots else None, slots, attention_mask,
                      position_ids, rope)  # (B, L, h)
        if cfg.state_init == "random" and self.training:
            s = torch.nn.init.trunc_normal_(torch.empty_like(e), std=cfg.state_sigma, a=-3 * cfg.state_sigma,
                                            b=3 * cfg.state_sigma)
        else:
            s = e
        active = valid.any(1)  # (B,) rows still recurring
        used = torch.zeros(b, dtype=torch.long, device=e.device)
        branch_log: list[torch.Tensor] = []
        prev_logp: torch.Tensor | None = None
        coda_slots = [len(self.prelude) + i for i in range(len(self.coda))]
        for t in range(steps_max):
            track = grad_steps is None or t >= steps_max - grad_steps
            with torch.set_grad_enabled(torch.is_grad_enabled() and track):
                h = self.adapter(torch.cat([s, e], -1))  # (B, L, h)
                if not self.use_branches:  # the plain recurrent core (the benchmark's baseline)
                    branch, gate = torch.zeros(b, dtype=torch.long, device=h.device), None
                elif route_per_token:
                    branch, gate = self._route_tokens(h)
                else:
                    branch, gate, _scores = self.route(h, valid)
                self._set_route(branch if self.use_branches else None, gate)
                step_slot = t % share if share else t
                core_slots = [slots.core_slot(step_slot, i) for i in range(len(self.core))] if slots else None
                try:
                    y = self._run(self.core, h, core_slots, slots, attention_mask, position_ids, rope)
                finally:
                    self._set_route(None, None)
                running = active & (rec > t)  # (B,)
                s = torch.where(running[:, None, None], y, s)
            used += running.long()
            branch_log.append(torch.where(running, branch if branch.dim() == 1 else branch[:, -1], -1))
            if self.balancer is not None and self.training:  # training: balance after every routing round
                self.balancer.update(counts_of(branch_log[-1], cfg.branches))
            active = running
            if bool((exit_kl > 0).any()) and t + 1 < steps_max:
                with torch.no_grad():
                    if slots is not None:
                        slots.peek = True
                    try:
                        probe = self._run(self.coda, s, coda_slots if slots else None, slots, attention_mask,
                                          position_ids, rope)
                    finally:
                        if slots is not None:
                            slots.peek = False
                    logp = torch.log_softmax(self.head(probe[:, -1]).float(), -1)  # (B, V)
                    if prev_logp is not None:
                        kl = (prev_logp.exp() * (prev_logp - logp)).sum(-1)  # KL(p_{t-1} || p_t)
                        active = active & ~((exit_kl > 0) & (kl < exit_kl))
                    prev_logp = logp
            if not bool(active.any()):
                break
        if slots is not None:
            self._fill_late_slots(slots, used, len(branch_log), l, share)
        out = self._run(self.coda, s, coda_slots if slots else None, slots, attention_mask, position_ids, rope)
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            out = out[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            out = out.index_select(1, logits_to_keep)
        logs = torch.stack(branch_log, 1).tolist() if branch_log else [[] for _ in range(b)]  # (B, steps)
        self.reports = [RowReport([x for x in row if x >= 0], int(n)) for row, n in zip(logs, used.tolist())]
        return MoDrOutput(self.head(out))

    def _route_tokens(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = torch.sigmoid(self.router(h))  # (B, L, N)
        branch = torch.argmax(r + self.router_bias, -1)  # (B, L)
        return branch, r.gather(-1, branch[..., None]).squeeze(-1)

    def _fill_late_slots(self, slots: StepSlots, used: torch.Tensor, ran: int, n_new: int, share: int | None) -> None:
        """Tokens that stopped before the last slot: copy their last step's K/V into the later slots.

        Slots no row reached in this forward get the last written step's columns appended first, so
        every cache layer keeps the same length."""
        total = slots.steps_held()
        slots.pad_unwritten((ran - 1) % share if share else ran - 1, n_new)
        for row in range(used.shape[0]):
            last = int(used[row]) - 1
            if last < 0:
                continue
            src_step = last % share if share else last
            for step in range(last + 1, total if not share else min(total, ran)):
                dst = step % share if share else step
                if dst == src_step:
                    continue
                rows = torch.tensor([row], device=used.device)
                for i in range(slots.n_core):
                    slots.copy_tail(slots.core_slot(dst, i), slots.core_slot(src_step, i), rows, n_new)

