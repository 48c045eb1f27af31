"""Training upcycled MoE models (docs/methods.md §6): ``chorus train moe``.

A dense Llama base is first upcycled (`moe.upcycle`) into the router's layout (Switch and GShard:
Mixtral, top-1 / top-2; DeepSeek: DeepSeek-V3 blocks with a shared expert), with a little noise on
the expert copies so they can diverge; an MoE checkpoint (Mixtral, Qwen2-MoE, DeepSeek-V3 / GLM-4-MoE)
is trained as it is. The MoE blocks are wrapped in `MoELayer` with the chosen router; the experts,
shared experts and routers train, everything else (attention, norms, embeddings) stays frozen. The
loss is the language-model loss plus each router's auxiliary terms; after each step the DeepSeek
router's selection bias moves (auxiliary-loss-free). ``router="dense"`` fine-tunes the dense
base's MLPs the same way: the baseline the evidence compares with.

The result is written with transformers' ``save_pretrained`` (hub layout) plus the tokenizer and a
manifest holding the run's summary (losses, expert loads, dropped share), atomically.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from chorus.engines.families.balance import load_stats
from chorus.engines.families.checkpoint import (
    atomic_output,
    check_new_dir,
    copy_tokenizer,
    read_config,
    write_manifest,
)
from chorus.engines.families.moe import UpcycleConfig, upcycle
from chorus.engines.families.moe_layer import MoELayer, unwrap_all, wrap_all
from chorus.engines.families.moe_routing import DEFAULT_LAYOUT, GATES
from chorus.errors import BuildError
from chorus.training.data import pack, read_texts

MOE_TYPES = ("mixtral", "qwen2_moe", "glm4_moe", "deepseek_v3")


#: settings that only some routers use; None = not given (the router's default applies)
ROUTER_ONLY = {"top_k": ("deepseek",), "capacity_factor": ("switch", "gshard"), "z_weight": ("switch", "gshard"),
               "jitter": ("switch",), "bias_speed": ("deepseek",), "aux_weight": ("switch", "gshard", "deepseek")}
DEFAULTS = {"top_k": 2, "capacity_factor": 1.25, "z_weight": 0.001, "jitter": 0.0, "bias_speed": 0.001}
OPTION = {"top_k": "--top-k", "capacity_factor": "--capacity", "z_weight": "--z-weight", "jitter": "--jitter",
          "bias_speed": "--bias-speed", "aux_weight": "--aux-weight", "experts": "--experts", "noise": "--noise"}


@dataclass
class MoeTrainConfig:
    """Training settings. The router-specific ones default to None ("not given"): a router uses its own
    default, and a setting given for a router that has no use for it is refused rather than ignored."""

    router: str = "switch"  # switch | gshard | deepseek | dense
    experts: int | None = None  # when upcycling a dense base (default 4)
    top_k: int | None = None  # DeepSeek's k (default 2; Switch is top-1, GShard top-2)
    noise: float | None = None  # upcycling noise on the expert copies (default 0.01)
    steps: int = 50
    batch_size: int = 4
    seq_len: int = 128
    lr: float = 1e-4
    capacity_factor: float | None = None  # Switch / GShard (default 1.25)
    aux_weight: float | None = None  # 0.01 for Switch / GShard, 0 for DeepSeek (auxiliary-loss-free)
    z_weight: float | None = None  # router z-loss, Switch and GShard (default 0.001)
    jitter: float | None = None  # Switch's router-input noise (default 0)
    bias_speed: float | None = None  # DeepSeek's bias step per training step (default 0.001)
    eval_sequences: int = 8  # held out from the start of the packed data (at most a fifth of it)
    seed: int = 0
    device: str = "cpu"
    log_every: int = 10

    def check(self) -> None:
        if self.router not in (*GATES, "dense"):
            raise BuildError(f"--router must be one of {', '.join([*GATES, 'dense'])} (got {self.router!r})")
        if self.steps < 1 or self.batch_size < 1 or self.seq_len < 8 or self.eval_sequences < 1:
            raise BuildError("need steps >= 1, batch size >= 1, sequence length >= 8 and eval sequences >= 1")
        if not self.lr > 0:
            raise BuildError(f"--lr must be > 0 (got {self.lr})")
        for name, routers in ROUTER_ONLY.items():
            if getattr(self, name) is not None and self.router not in routers:
                raise BuildError(f"{OPTION[name]} applies to --router {' / '.join(routers)}, not {self.router}")
        if self.bias_speed is not None and self.bias_speed < 0:
            raise BuildError(f"--bias-speed must be >= 0 (got {self.bias_speed})")
        if self.router == "dense":
            for name in ("experts", "noise"):
                if getattr(self, name) is not None:
                    raise BuildError(f"{OPTION[name]} applies to upcycling, not to --router dense")

    def router_settings(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: DEFAULTS[k] if getattr(self, k) is None else getattr(self, k) for k in DEFAULTS}
        out["aux_weight"] = self.aux_weight if self.aux_weight is not None else (
            0.0 if self.router == "deepseek" else 0.01)
        out["generator"] = torch.Generator().manual_seed(self.seed)
        return out


def _device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BuildError("--device cuda: no CUDA device is available")
    return device


def prepare_base(base: Path, tc: MoeTrainConfig, work: Path, log: Callable[[str], None]) -> Path:
    """The MoE checkpoint to train: ``base`` itself, or ``base`` upcycled into the router's layout."""
    kind = read_config(base).get("model_type")
    if tc.router == "dense" and kind in MOE_TYPES:
        raise BuildError("--router dense fine-tunes a dense base; this base is already an MoE model")
    if kind in MOE_TYPES:
        for name in ("experts", "noise"):
            if getattr(tc, name) is not None:
                raise BuildError(f"{OPTION[name]} applies to upcycling a dense base; {base.name} is already an MoE "
                                 f"model ({kind})")
    if tc.router == "dense" or kind in MOE_TYPES:
        return base
    top_k = {"switch": 1, "gshard": 2}.get(tc.router, tc.top_k or DEFAULTS["top_k"])
    layout = DEFAULT_LAYOUT[tc.router]
    cfg = UpcycleConfig(experts=tc.experts or 4, top_k=top_k, layout=layout,  # type: ignore[arg-type]
                        noise=0.01 if tc.noise is None else tc.noise, seed=tc.seed)
    return upcycle(base, work / "upcycled", cfg, log=log)


def _trainable(model: Any, layers: list[MoELayer] | None) -> list[torch.nn.Parameter]:
    for p in model.parameters():
        p.requires_grad_(False)
    if layers is None:  # dense: every MLP
        params = [p for layer in model.model.layers for p in layer.mlp.parameters()]
    else:
        params = list({id(p): p for moe in layers for p in moe.parameters()}.values())
    for p in params:
        p.requires_grad_(True)
    return params


def train_moe(base: Path | str, data: Path | str, out: Path | str, tc: MoeTrainConfig, *, force: bool = False,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train and write an MoE (or, ``router="dense"``, a dense) checkpoint; returns the run's summary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tc.check()
    base, data = Path(base).expanduser().resolve(), Path(data).expanduser()
    out = check_new_dir(out, force)
    if not (base / "config.json").is_file():
        raise BuildError(f"{base} is not a checkpoint directory (no config.json)")
    device = _device(tc.device)
    texts = read_texts(data)
    tok = AutoTokenizer.from_pretrained(base)
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0
    seqs = pack([tok(t, add_special_tokens=False)["input_ids"] for t in texts], eos, tc.seq_len)
    n_eval = min(tc.eval_sequences, max(1, len(seqs) // 5))
    held, train = seqs[:n_eval], seqs[n_eval:]
    torch.manual_seed(tc.seed)
    with tempfile.TemporaryDirectory(prefix="chorus-moe-") as work:
        start = prepare_base(base, tc, Path(work), log)
        model: Any = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    model.to(device)
    layers = None if tc.router == "dense" else wrap_all(model, tc.router, **tc.router_settings())
    params = _trainable(model, layers)
    n_params = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=tc.lr, weight_decay=0.0, fused=True)  # fused: one kernel, CPU or GPU

    def lm_loss(batch: torch.Tensor) -> torch.Tensor:  # training: the mean over every token of the batch
        logits = model(input_ids=batch[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))

    def held_losses() -> list[float]:
        """Mean token loss of each held-out sequence, with the model as served (evaluation mode)."""
        model.eval()
        out: list[float] = []
        with torch.no_grad():
            for i in range(0, len(held), tc.batch_size):
                batch = held[i: i + tc.batch_size].to(device)
                logits = model(input_ids=batch[:, :-1]).logits.float()
                per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none")
                out += per_token.mean(1).tolist()
        model.train()
        return out

    before_each = held_losses()
    before = sum(before_each) / len(before_each)
    n_layers = len(layers or [])
    experts = layers[0].router.experts if layers else 0
    loads = torch.zeros(n_layers, experts, dtype=torch.long)
    dropped = decisions = 0
    aux_total = 0.0
    log(f"training {tc.router}: {len(train)} sequences of {tc.seq_len} tokens, "
        f"{n_params:,} trainable parameters; held-out loss {before:.4f}")
    gen = torch.Generator().manual_seed(tc.seed)
    t0 = time.perf_counter()
    model.train()
    losses: list[float] = []
    for step in range(1, tc.steps + 1):
        batch = train[torch.randint(0, len(train), (tc.batch_size,), generator=gen)].to(device)
        loss = lm_loss(batch)
        aux = sum((moe.last.aux for moe in layers if moe.last is not None), loss.new_zeros(())) if layers else None
        total = loss + aux if aux is not None else loss
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        for i, moe in enumerate(layers or []):
            moe.router.step_end()
            r = moe.last
            assert r is not None
            loads[i] += r.counts.cpu()
            dropped += r.dropped
            decisions += int(r.counts.sum())
        aux_total += float(aux.detach()) if aux is not None else 0.0
        losses.append(float(loss.detach()))
        if step % tc.log_every == 0 or step == tc.steps:
            recent = losses[-tc.log_every:]
            extra = f"  load cv {load_stats(loads)['cv']:.3f}" if layers else ""
            log(f"step {step:4d}  loss {sum(recent) / len(recent):.4f}{extra}  {time.perf_counter() - t0:.0f}s")
    seconds = time.perf_counter() - t0
    after_each = held_losses()
    after = sum(after_each) / len(after_each)
    model.eval()
    summary: dict[str, Any] = {"router": tc.router, "loss_before": round(before, 4), "loss_after": round(after, 4),
                               "held_out_sequences": len(held), "held_out_losses": [round(x, 5) for x in after_each],
                               "steps": tc.steps, "seconds": round(seconds, 1),
                               "train_tokens_per_s": round(tc.steps * tc.batch_size * (tc.seq_len - 1) / seconds, 1),
                               "trainable_parameters": n_params, "data": str(data),
                               "train": asdict(tc)}
    if layers:
        summary.update(load=load_stats(loads), loads=loads.tolist(), aux_loss_mean=round(aux_total / tc.steps, 5),
                       dropped_share=round(dropped / max(1, decisions), 4))
        if layers[0].router.bias is not None:
            summary["selection_bias"] = [[round(float(b), 4) for b in moe.router.bias.tolist()] for moe in layers
                                         if moe.router.bias is not None]
        unwrap_all(model)
        model.config.num_experts_per_tok = layers[0].router.top_k
    for p in model.parameters():
        p.requires_grad_(False)
    model.to("cpu")
    with atomic_output(out, force) as tmp:
        model.save_pretrained(tmp)
        copy_tokenizer(base, tmp)
        write_manifest(tmp, {"family": "moe" if layers else "dense", "base": str(base), "training": summary})
    log(f"held-out loss {before:.4f} -> {after:.4f}"
        + (f"; load cv {summary['load']['cv']}, max/min {summary['load']['max_min']}, dropped "
           f"{summary['dropped_share']:.2%}" if layers else "") + f"; saved to {out}")
    return summary
