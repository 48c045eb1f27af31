"""Mixture-of-Experts: sparse upcycling (docs/methods.md §6) and expert-load observation.

`upcycle` turns a dense Llama-architecture checkpoint into a standard MoE checkpoint that
transformers and vLLM load unchanged, in the Hugging Face hub layout:

- Mixtral (default): every expert is a copy of the layer's MLP (``w1`` = gate, ``w3`` = up,
  ``w2`` = down) and a new router ``block_sparse_moe.gate`` (experts x hidden). Mixtral takes a
  softmax over the router logits and renormalises the top-k weights, so with identical experts
  (no noise) the MoE computes exactly the dense model, whatever the router.
- Qwen2-MoE with a gated shared expert (``--layout qwen2_moe``, or ``--shared-expert``): output =
  routed + sigmoid(w_sg . x) * shared. The shared expert is the MLP copied, its gate starts at zero
  (sigmoid = 1/2) and every routed expert's down projection is halved, so again the dense model is
  reproduced exactly; training moves the gate and the experts apart.
- DeepSeek-V3 MoE blocks (``--layout deepseek_v3``): sigmoid router with a selection bias
  (``e_score_correction_bias``, zero), top-k weights normalised, an ungated shared expert. Shared
  and routed copies both have their down projection halved: 1/2 shared + 1/2 routed = the dense
  MLP. DeepSeek-V3's own model class needs multi-head latent attention, which a Llama's attention
  cannot be written as; the checkpoint is therefore a ``Glm4MoeForCausalLM`` (GLM-4-MoE: Llama
  attention with full rotary embedding, DeepSeek-V3's MoE block and tensor names), which
  transformers and vLLM serve.

Two fields follow what vLLM builds rather than what the config says (found serving them on vLLM
0.32.0, which otherwise answers from uninitialised weights): vLLM's Qwen2-MoE attention always has
q/k/v biases, so ``qkv_bias`` is true and zero biases are written; vLLM's GLM-4-MoE never ties the
head to the embeddings, so a tied base's head is written out as ``lm_head.weight``.

Router initialisation: ``random`` (normal, std 0.02) or ``hidden``: the rows are the leading
principal directions of that layer's MLP inputs on a built-in calibration text, so experts start
out receiving different tokens. ``noise`` perturbs each expert copy by ``noise * std(W)`` Gaussian
noise (seeded), which breaks the exact equivalence on purpose.

`ExpertLoad` counts, per layer, the tokens routed to each expert during serving (hooks on the
routers), for Prometheus and a request's trace.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from chorus.engines.families.checkpoint import (
    Base,
    atomic_output,
    check_new_dir,
    copy_tokenizer,
    load_base,
    save_checkpoint,
)
from chorus.engines.families.moe_routing import LAYOUTS
from chorus.engines.runtime.metric import Metric
from chorus.engines.runtime.observer import FamilyObserver
from chorus.errors import BuildError

CALIBRATION = (
    "The quick brown fox jumps over the lazy dog. In 1492 Columbus sailed the ocean blue. "
    "def add(a, b):\n    return a + b\n"
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "Bonjour, comment allez-vous aujourd'hui ? Photosynthesis converts light energy into chemical energy. "
    "SELECT name FROM users WHERE age > 30; The mitochondria is the powerhouse of the cell. "
    "To be, or not to be, that is the question. 3 + 4 * 2 = 11. Water boils at 100 degrees Celsius."
)


@dataclass(frozen=True)
class UpcycleConfig:
    experts: int = 4
    top_k: int = 2
    shared_expert: bool = False
    router: Literal["random", "hidden"] = "random"
    layout: Literal["mixtral", "qwen2_moe", "deepseek_v3"] = "mixtral"
    noise: float = 0.0
    seed: int = 0

    @classmethod
    def tiny(cls) -> UpcycleConfig:
        return cls(experts=4, top_k=2)

    def check(self) -> None:
        if self.experts < 2:
            raise BuildError(f"--experts must be at least 2 (got {self.experts})")
        if not 1 <= self.top_k <= self.experts:
            raise BuildError(f"--top-k must be between 1 and --experts={self.experts} (got {self.top_k})")
        if self.router not in ("random", "hidden"):
            raise BuildError(f"--router must be random or hidden (got {self.router!r})")
        if self.noise < 0:
            raise BuildError(f"--noise must be >= 0 (got {self.noise})")
        if self.layout not in LAYOUTS:
            raise BuildError(f"--layout must be {', '.join(LAYOUTS[:-1])} or {LAYOUTS[-1]} (got {self.layout!r})")
        if self.shared_expert and self.layout == "deepseek_v3":
            raise BuildError("--shared-expert selects the qwen2_moe layout; it does not combine with deepseek_v3")

    @property
    def kind(self) -> str:
        """The layout written: mixtral, qwen2_moe or deepseek_v3."""
        return "qwen2_moe" if self.shared_expert else self.layout

    @property
    def model_type(self) -> str:
        return {"mixtral": "mixtral", "qwen2_moe": "qwen2_moe", "deepseek_v3": "glm4_moe"}[self.kind]


# config keys both MoE formats take over from the dense base unchanged
_SHARED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
                "rope_theta", "rope_scaling", "tie_word_embeddings", "bos_token_id", "eos_token_id",
                "pad_token_id", "initializer_range", "attention_dropout", "dtype", "torch_dtype")


def moe_config(base: dict[str, Any], cfg: UpcycleConfig) -> dict[str, Any]:
    out = {k: base[k] for k in _SHARED_KEYS if k in base}
    inter = int(base["intermediate_size"])
    if cfg.kind == "deepseek_v3":
        rope = dict(base.get("rope_parameters") or {"rope_type": "default", "rope_theta": base.get("rope_theta", 1e4)})
        out.update(model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], n_routed_experts=cfg.experts,
                   num_experts_per_tok=cfg.top_k, moe_intermediate_size=inter, intermediate_size=inter,
                   n_shared_experts=1, routed_scaling_factor=1.0, n_group=1, topk_group=1, first_k_dense_replace=0,
                   norm_topk_prob=True, use_qk_norm=False, attention_bias=False, num_nextn_predict_layers=0,
                   rope_parameters={**rope, "partial_rotary_factor": 1.0}, partial_rotary_factor=1.0,
                   output_router_logits=False, tie_word_embeddings=False)  # vLLM's GLM-4-MoE never ties: see below
        out.pop("rope_theta", None)
    elif cfg.kind == "qwen2_moe":
        out.update(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], num_experts=cfg.experts,
                   num_experts_per_tok=cfg.top_k, moe_intermediate_size=inter, shared_expert_intermediate_size=inter,
                   intermediate_size=inter, norm_topk_prob=True, qkv_bias=True, decoder_sparse_step=1,
                   mlp_only_layers=[], use_sliding_window=False, sliding_window=None, router_aux_loss_coef=0.001,
                   output_router_logits=False)
    else:
        out.update(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=cfg.experts,
                   num_experts_per_tok=cfg.top_k, intermediate_size=inter, sliding_window=None,
                   router_jitter_noise=0.0, router_aux_loss_coef=0.02, output_router_logits=False)
    out["chorus"] = {"family": "moe", "upcycled_from": base.get("_name_or_path") or base.get("model_type"),
                     "experts": cfg.experts, "top_k": cfg.top_k, "layout": cfg.kind,
                     "router": cfg.router, "noise": cfg.noise}
    return out


def _noisy(w: torch.Tensor, scale: float, gen: torch.Generator) -> torch.Tensor:
    if scale == 0:
        return w.clone()
    return w + torch.randn(w.shape, generator=gen, dtype=w.dtype) * (scale * float(w.std()))


@torch.inference_mode()
def hidden_routers(base_dir: Path, experts: int) -> list[torch.Tensor]:
    """Per layer, the top principal directions of the MLP inputs on the calibration text (experts x hidden)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if any((base_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        ids = AutoTokenizer.from_pretrained(base_dir)(CALIBRATION, return_tensors="pt")["input_ids"]
    else:  # a checkpoint without a tokenizer (test presets): the text's bytes as token ids
        ids = torch.tensor([[b % model.config.vocab_size for b in CALIBRATION.encode()]])
    seen: list[torch.Tensor] = []
    hooks = [layer.post_attention_layernorm.register_forward_hook(lambda m, i, o: seen.append(o[0].float()))
             for layer in model.model.layers]
    try:
        model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    routers = []
    for x in seen:  # (T, h)
        centred = x - x.mean(0, keepdim=True)
        _, _, v = torch.linalg.svd(centred, full_matrices=False)  # v: (min(T,h), h)
        dirs = v[:experts]
        if dirs.shape[0] < experts:  # fewer tokens than experts: fill with random directions
            dirs = torch.cat([dirs, torch.randn(experts - dirs.shape[0], x.shape[1])])
        routers.append(torch.nn.functional.normalize(dirs, dim=-1) * x.norm(dim=-1).mean().reciprocal() * 8)
    return routers


def moe_tensors(base: Base, cfg: UpcycleConfig, routers: list[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(cfg.seed)
    hidden = int(base.config["hidden_size"])
    tensors = dict(base.outside_layers())
    if cfg.kind == "deepseek_v3" and "lm_head.weight" not in tensors:  # a tied base: the head written out
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    for i in range(base.n_layers):
        layer = base.layer(i)
        pre = f"model.layers.{i}."
        for name, t in layer.items():
            if not name.startswith("mlp."):
                tensors[pre + name] = t
        if cfg.kind == "qwen2_moe":  # Qwen2-MoE's attention has q/k/v biases (vLLM always builds them): zero ones
            for proj in ("q_proj", "k_proj", "v_proj"):
                key = pre + f"self_attn.{proj}.bias"
                if key not in tensors:
                    w = tensors[pre + f"self_attn.{proj}.weight"]
                    tensors[key] = torch.zeros(w.shape[0], dtype=w.dtype)
        gate, up, down = layer["mlp.gate_proj.weight"], layer["mlp.up_proj.weight"], layer["mlp.down_proj.weight"]
        if routers is not None:
            router = routers[i].to(gate.dtype)
        else:
            router = torch.randn(cfg.experts, hidden, generator=gen, dtype=gate.dtype) * 0.02
        if cfg.kind in ("qwen2_moe", "deepseek_v3"):  # a shared expert next to routed ones: each half the MLP
            tensors[pre + "mlp.gate.weight"] = router
            if cfg.kind == "deepseek_v3":  # ungated shared expert: its down projection carries the half
                tensors[pre + "mlp.gate.e_score_correction_bias"] = torch.zeros(cfg.experts, dtype=torch.float32)
                shared, shared_down = "mlp.shared_experts", down * 0.5
            else:  # the shared gate starts at 0: sigmoid = 1/2
                tensors[pre + "mlp.shared_expert_gate.weight"] = torch.zeros(1, hidden, dtype=gate.dtype)
                shared, shared_down = "mlp.shared_expert", down
            for proj, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", shared_down)):
                tensors[pre + f"{shared}.{proj}.weight"] = w
            for e in range(cfg.experts):
                ex = pre + f"mlp.experts.{e}."
                tensors[ex + "gate_proj.weight"] = _noisy(gate, cfg.noise, gen)
                tensors[ex + "up_proj.weight"] = _noisy(up, cfg.noise, gen)
                tensors[ex + "down_proj.weight"] = _noisy(down, cfg.noise, gen) * 0.5  # the routed half
        else:
            tensors[pre + "block_sparse_moe.gate.weight"] = router
            for e in range(cfg.experts):
                ex = pre + f"block_sparse_moe.experts.{e}."
                tensors[ex + "w1.weight"] = _noisy(gate, cfg.noise, gen)
                tensors[ex + "w3.weight"] = _noisy(up, cfg.noise, gen)
                tensors[ex + "w2.weight"] = _noisy(down, cfg.noise, gen)
    return tensors


def build_upcycle(base_dir: Path | str, out: Path | str, options: dict[str, Any], *, force: bool = False,
                  log: Any = print) -> Path:
    """``derive: {family: moe, options: {...}}``: `upcycle` with an `UpcycleConfig` of ``options``."""
    return upcycle(base_dir, out, UpcycleConfig(**options), force=force, log=log)


def upcycle(base_dir: Path | str, out: Path | str, cfg: UpcycleConfig, *, force: bool = False,
            log: Any = print) -> Path:
    cfg.check()
    out = check_new_dir(out, force)
    t0 = time.perf_counter()
    base = load_base(base_dir, "upcycle")
    routers = hidden_routers(base.path, cfg.experts) if cfg.router == "hidden" else None
    tensors = moe_tensors(base, cfg, routers)
    config = moe_config(base.config, cfg)
    with atomic_output(out, force) as tmp:
        copy_tokenizer(base.path, tmp)
        save_checkpoint(tmp, config, tensors, {"family": "moe", "base": str(base.path), **config["chorus"],
                                               "seconds": round(time.perf_counter() - t0, 1)})
    log(
        f"upcycled {base.path.name} into {cfg.kind} ({config['architectures'][0]}) with {cfg.experts} experts, "
        f"top-{cfg.top_k} at {out}"
    )
    return out


def is_moe_block(module: Any) -> bool:
    """A transformers MoE block: a router ``gate`` next to its ``experts`` (Mixtral, Qwen2-MoE, DeepSeek, ...)."""
    return hasattr(module, "gate") and hasattr(module, "experts")


class ExpertLoad(FamilyObserver):
    """Counts tokens routed to each expert per layer, from forward hooks on the model's routers.

    The batching engine's `FamilyObserver` for MoE models: after each forward the routing decisions of real tokens
    are split between the sequences they belong to (``session.family``: a (layers, experts) count)
    and added to ``totals`` (since start-up, for Prometheus). Padding tokens are routed by the model
    too but never counted.
    """

    def __init__(self, model: Any) -> None:
        cfg = model.config.get_text_config()
        self.top_k = int(getattr(cfg, "num_experts_per_tok", 1))
        self.routers = [m.gate for m in model.modules() if is_moe_block(m)]
        self.layers = len(self.routers)
        self.experts = int(getattr(cfg, "num_local_experts", 0) or getattr(cfg, "num_experts", 0)
                           or getattr(cfg, "n_routed_experts", 0))
        self.totals = torch.zeros(self.layers, self.experts, dtype=torch.long)
        self._current: list[torch.Tensor] = []
        self._hooks = [r.register_forward_hook(self._hook) for r in self.routers]

    @staticmethod
    def applies_to(model: torch.nn.Module) -> bool:
        return any(is_moe_block(m) for m in model.modules())

    def _hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, tuple):  # (logits, weights, indices) routers
            idx = next((o for o in reversed(output) if isinstance(o, torch.Tensor) and not o.is_floating_point()), None)
            if idx is None:
                idx = torch.topk(output[0], self.top_k, dim=-1).indices
        else:  # a plain linear router: logits
            idx = torch.topk(output, self.top_k, dim=-1).indices
        self._current.append(idx.reshape(-1, idx.shape[-1]).detach())  # (tokens, k)

    def before(self, rows: list[Any]) -> None:
        self._current = []

    def after(self, rows: list[Any], lens: list[int], width: int) -> None:
        for b, (session, n) in enumerate(zip(rows, lens)):
            if session is None or n == 0:
                continue
            counts = self.count(torch.arange(b * width, b * width + n))
            self.totals += counts
            session.family = counts if session.family is None else session.family + counts
        self._current = []

    def count(self, flat: torch.Tensor) -> torch.Tensor:
        """(layers, experts) counts over the given flattened token positions of the last forward."""
        counts = torch.zeros(self.layers, self.experts, dtype=torch.long)
        for layer, idx in enumerate(self._current[: self.layers]):
            chosen = idx.index_select(0, flat.to(idx.device)).reshape(-1).cpu()
            counts[layer] += torch.bincount(chosen, minlength=self.experts)[: self.experts]
        return counts

    def trace(self, sessions: list[Any]) -> dict[str, Any]:
        parts = [s.family for s in sessions if s.family is not None]
        return {
            "experts": load_summary(sum(parts) if parts else torch.zeros(self.layers, self.experts, dtype=torch.long))
        }

    def metrics(self) -> list[Metric]:
        samples = [
            ([str(l), str(e)], float(self.totals[l, e])) for l in range(self.layers) for e in range(self.experts)
        ]
        return [("chorus_moe_expert_tokens_total", "Tokens routed to each expert, per MoE layer (top-k: k per token)",
                 ["layer", "expert"], samples)]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


def load_summary(counts: torch.Tensor) -> dict[str, Any]:
    """A trace-friendly view of (layers, experts) counts: per-layer lists and a balance figure.

    ``balance`` is the mean over layers of (min / max) tokens per expert: 1.0 is perfectly even,
    0 means some expert got nothing.
    """
    c = counts.float()
    per_layer = (c.min(1).values / c.max(1).values.clamp(min=1)).mean()
    return {"tokens_per_expert": counts.tolist(), "balance": round(float(per_layer), 4)}
