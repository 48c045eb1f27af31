"""ReasonFormer on vLLM: chorus's forward (families/reasonformer/model.py) on vLLM's layers and paged KV cache.

    state = rep(embed(x))
    step i = 1..T:  gate g_i = sigmoid(G_i(pool(state)))   (step 1 always runs; a sequence stops when g_i < threshold)
                    skills, weights = top-k of router_i(state);  mix = sum_q w_q block_{skill q, step i}(state)
                    state = state + coef_i (mix - state),   coef_i = product of the gates so far
    out = norm(coda(state))

As in chorus's engine, the routing and the stop decision are made once per sequence, on its prompt (the pool
and the router's small transformer layer read the prompt's tokens of the forward), and kept for its decoded
tokens. vLLM does not tell a model which request a token belongs to, so the plugin wraps vLLM's model runner
(``_model_forward``: the ids of the batch's requests, in the order of their tokens; ``_update_states``: the
requests that finished, whose decisions are dropped). A request that vLLM preempts and recomputes keeps its
decision. KV slots: one per (block layer, step, chosen-skill rank), as chorus's engine keeps them; steps a
sequence never runs are never read by it."""

from __future__ import annotations

from dataclasses import dataclass, field
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
from chorus.engines.families.reasonformer.model import SkillRouter, StopGate

#: the ids of the requests of the forward under way, in token order (set by the wrapped model runner)
BATCH: list[str] = []
#: requests vLLM finished since the last forward
FINISHED: set[str] = set()


def track_requests() -> None:
    """Wrap vLLM's model runner once, so the model knows the request of every sequence of its batch."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_chorus_tracked", False):
        return
    forward, update = GPUModelRunner._model_forward, GPUModelRunner._update_states

    def _model_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        BATCH[:] = [r for r in self.input_batch.req_ids if r is not None]
        try:
            return forward(self, *args, **kwargs)
        finally:
            BATCH.clear()

    def _update_states(self: Any, scheduler_output: Any) -> Any:
        FINISHED.update(scheduler_output.finished_req_ids)
        return update(self, scheduler_output)

    GPUModelRunner._model_forward = _model_forward
    GPUModelRunner._update_states = _update_states
    GPUModelRunner._chorus_tracked = True


@dataclass
class Decision:
    """A sequence's reasoning, decided on its prompt: per step run, its skills, their weights and the coefficient."""

    skills: list[list[int]] = field(default_factory=list)
    weights: list[list[float]] = field(default_factory=list)
    coefs: list[float] = field(default_factory=list)

    @property
    def depth(self) -> int:
        return len(self.skills)


class ReasonFormerForCausalLM(OverBaseForCausalLM):
    family = "reasonformer"
    what = "ReasonFormer"

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        track_requests()
        s = self.settings
        self.steps, self.n_skills = int(s["max_steps"]), len(s["skills"])
        self.k = self.n_skills if s.get("top_k") is None else int(s["top_k"])
        self.threshold = float(s["stop_threshold"])
        self.shared = s["kind"] == "shared"
        self.targets: list[str] = list(s["targets"])
        h = self.config.hidden_size
        self.routers = torch.nn.ModuleList(SkillRouter(h, self.n_skills, int(s["router_dim"]), int(s["router_heads"]))
                                           for _ in range(self.steps))
        self.gates = torch.nn.ModuleList(StopGate(h, int(s["router_dim"])) for _ in range(self.steps - 1))
        block = self.span("block")
        # slot (step i, rank q, block layer j): step 0 rank 0 is the block layers' own
        self.block_slots = {(i, q): [self.model.layers[b].self_attn.attn if (i, q) == (0, 0)
                                     else self.new_slot(self.model.layers[b].self_attn) for b in block]
                            for i in range(self.steps) for q in range(self.k)}
        self.loras: list[list[tuple[LoRADelta | None, LoRADelta | None, float]]] = []  # per layer, per bank
        self.decisions: dict[str, Decision] = {}

    def load_own(self, tensors: dict[str, torch.Tensor]) -> None:
        ref = self.model.embed_tokens.weight
        get = lambda name: tensors[name].to(device=ref.device, dtype=ref.dtype)  # noqa: E731
        with torch.no_grad():
            for prefix, modules in (("routers", self.routers), ("gates", self.gates)):
                for name, p in modules.named_parameters():
                    p.copy_(get(f"{prefix}.{name}"))
        self.routers.to(device=ref.device, dtype=ref.dtype).eval()
        self.gates.to(device=ref.device, dtype=ref.dtype).eval()
        s, n_t = self.settings, len(self.targets)
        ranks = [int(s["rank"]), int(s["adapter_rank"])] if self.shared else [int(s["rank"])]
        self.loras = []
        for j, b in enumerate(self.span("block")):
            sa: Any = self.model.layers[b].self_attn
            banks = []
            for bank, rank in enumerate(ranks):
                lora = {t: (get(f"lora.{j * n_t + k}.A{bank}"), get(f"lora.{j * n_t + k}.B{bank}"))
                        for k, t in enumerate(self.targets)}
                qkv = None
                if any(t in lora for t in ("q_proj", "k_proj", "v_proj")):
                    entries = next(iter(lora.values()))[0].shape[0]
                    qkv = stack_qkv([lora.get(t) for t in ("q_proj", "k_proj", "v_proj")],
                                    (sa.q_size, sa.kv_size, sa.kv_size), rank, entries, ref.shape[1])
                    qkv.a, qkv.b = qkv.a.to(ref.device), qkv.b.to(ref.device)
                o = LoRADelta(*lora["o_proj"]) if "o_proj" in lora else None
                banks.append((qkv, o, float(s["alpha"]) / rank))
            self.loras.append(banks)

    def _route(self, i: int, state: torch.Tensor, seg: torch.Tensor, seqs: list[int]) -> dict[int, tuple[list[int],
                                                                                                       list[float]]]:
        """Step i's skills and renormalised weights for the sequences ``seqs``, each over its own tokens."""
        out = {}
        for s in seqs:
            h = state[seg == s][None]  # (1, L, h)
            probs = self.routers[i](h, torch.ones(h.shape[:2], dtype=torch.bool, device=h.device))  # (1, n)
            p, sel = probs.topk(self.k, -1)
            out[s] = (sel[0].tolist(), (p / p.sum(-1, keepdim=True))[0].tolist())
        return out

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors: Any = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        for req in FINISHED:
            self.decisions.pop(req, None)
        FINISHED.clear()
        x = inputs_embeds if inputs_embeds is not None else self.model.embed_input_ids(input_ids)
        state = self.run(self.span("representation"), positions, x)
        dev = state.device
        seg, n_seq = sequences(state.shape[0], dev)
        reqs: list[str | None] = list(BATCH[:n_seq - 1]) if len(BATCH) >= n_seq - 1 else [None] * (n_seq - 1)
        reqs.append(None)  # the padding index
        decided = [self.decisions.get(r) if r is not None else None for r in reqs]
        undecided = [s for s in range(n_seq - 1) if decided[s] is None and bool((seg == s).any())]
        cap = torch.tensor([d.depth if d is not None else self.steps for d in decided], device=dev)
        is_decided = torch.tensor([d is not None for d in decided], device=dev)
        coef = torch.ones(n_seq, device=dev)
        active = torch.ones(n_seq, dtype=torch.bool, device=dev)
        made: dict[int, Decision] = {s: Decision() for s in undecided}
        blk = self.span("block")
        for i in range(int(cap.max())):
            if i > 0 and undecided:
                pooled = sequence_mean(state, seg, n_seq)
                gate: Any = self.gates[i - 1]
                g = torch.sigmoid(gate.ffn(pooled).float()).squeeze(-1)  # (S,)
            else:
                g = torch.ones(n_seq, device=dev)
            coef = coef * g
            given = [d.coefs[i] if d is not None and i < d.depth else 1.0 for d in decided]
            coef = torch.where(is_decided, torch.tensor(given, device=dev), coef)
            if i > 0:
                active = active & (is_decided | (g >= self.threshold))
            running = active & (cap > i)
            if not bool(running.any()):
                break
            routed = self._route(i, state, seg, [s for s in undecided if bool(running[s])])
            sel = [[*range(self.k)]] * n_seq
            w = [[1.0 / self.k] * self.k] * n_seq
            for s, d in enumerate(decided):
                if d is not None and i < d.depth:
                    sel[s], w[s] = d.skills[i], d.weights[i]
                elif s in routed:
                    sel[s], w[s] = routed[s]
                    made[s].skills.append(sel[s])
                    made[s].weights.append(w[s])
                    made[s].coefs.append(float(coef[s]))
            sel_t = torch.tensor(sel, device=dev)[seg]  # (N, k)
            w_t = torch.tensor(w, device=dev)[seg]
            mix: torch.Tensor | None = None
            first: torch.Tensor | None = None
            for q in range(self.k):
                skill = sel_t[:, q]
                picks = [skill, skill * self.steps + i] if self.shared else [skill * self.steps + i]
                y = state
                for j, b in enumerate(blk):
                    loras = [Lora(qkv, o, pick, torch.full_like(pick, scale, dtype=y.dtype))
                             for (qkv, o, scale), pick in zip(self.loras[j], picks)]
                    y = layer_forward(self.model.layers[b], positions, y, self.block_slots[(i, q)][j], loras)
                if first is None or mix is None:
                    mix = first = y
                else:
                    mix = mix + w_t[:, q, None].to(y.dtype) * (y - first)
            assert mix is not None
            new = torch.lerp(state, mix, coef[seg][:, None].to(state.dtype))
            state = torch.where(running[seg][:, None], new, state)
            active = running
        for s, d in made.items():
            if reqs[s] is not None:
                self.decisions[str(reqs[s])] = d
        return self.finish(self.run(self.span("coda"), positions, state))
