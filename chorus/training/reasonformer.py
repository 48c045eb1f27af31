"""Training ReasonFormer (docs/methods.md §12): ``chorus train reasonformer``, in the paper's two stages.

1. Skill pre-training: each skill's modules on its own data, the router fixed to that skill and every
   step run in full (gates open), so each (skill, step) adapter learns.
2. Joint fine-tuning of the routers, the stop gates and all skill modules on batches mixing every
   skill's data; the loss adds ``depth_cost`` times the expected number of extra steps (the sum of the
   step coefficients after step 1), so a gate only stays open where the steps pay for themselves. The
   gates start stage 2 open (bias +2) when stage 1 ran, closed (bias -2) otherwise.

The base stays frozen. Data: one JSONL file (or row slice, ``PATH@START:END``) per skill, read by
`training.data.read_texts` (multiple-choice rows as their right answer), one example per sequence (no
packing: the router decides per example). The last ``eval_rows`` rows of each skill are held out:
loss per skill, the router's weights and the depth chosen are measured on them before and after.

`train_plain_lora` is the evidence's baseline: the same base, one LoRA on the same reasoning block
(rank chosen for the same number of trainable parameters), the same data and optimizer steps; it is
written merged into a plain dense checkpoint.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from chorus.engines.families.checkpoint import atomic_output, check_new_dir, copy_tokenizer, read_config, write_manifest
from chorus.engines.families.reasonformer.checkpoint import (
    is_reasonformer_dir,
    load_base_model,
    load_reasonformer,
    save_reasonformer,
)
from chorus.engines.families.reasonformer.config import ReasonFormerConfig
from chorus.engines.families.reasonformer.model import Decision, ReasonFormerModel, StopGate
from chorus.errors import BuildError
from chorus.training.data import pad_rows, parse_rows, read_texts


@dataclass
class TrainConfig:
    stage1_steps: int = 30  # per skill
    stage2_steps: int = 60
    batch_size: int = 4
    seq_len: int = 128
    lr: float = 1e-3
    depth_cost: float = 0.01
    eval_rows: int = 16  # per skill, held out
    seed: int = 0
    device: str = "cpu"
    log_every: int = 10

    def check(self) -> None:
        if self.stage1_steps < 0 or self.stage2_steps < 0 or self.stage1_steps + self.stage2_steps < 1:
            raise BuildError("need --stage1-steps >= 0 and --stage2-steps >= 0, not both 0")
        if self.batch_size < 1 or self.seq_len < 8 or self.eval_rows < 1:
            raise BuildError("need batch size >= 1, sequence length >= 8 and --eval-rows >= 1")
        if self.depth_cost < 0:
            raise BuildError(f"--depth-cost must be >= 0 (got {self.depth_cost})")


@dataclass
class SkillData:
    """One skill's examples as token ids, one example per sequence: training and held-out rows."""

    name: str
    train: list[list[int]]
    held: list[list[int]]
    pad: int
    seq_len: int

    def batch(self, rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = pad_rows(rows, self.pad, self.seq_len)
        return ids.to(device), mask.to(device)


def load_skill_data(specs: dict[str, str], tok: Any, tc: TrainConfig) -> list[SkillData]:
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0
    out = []
    for name, spec in specs.items():
        path, rows = parse_rows(spec)
        texts = read_texts(path, rows)
        if len(texts) < tc.eval_rows + tc.batch_size:
            raise BuildError(f"skill {name}: {spec} gives {len(texts)} rows; need at least --eval-rows + --batch-size "
                             f"= {tc.eval_rows + tc.batch_size}")
        ids = [[*tok(t, add_special_tokens=False)["input_ids"], eos] for t in texts]
        out.append(SkillData(name, ids[: -tc.eval_rows], ids[-tc.eval_rows:], eos, tc.seq_len))
    return out


def row_losses(model: Any, ids: torch.Tensor, mask: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, Any]:
    """Mean next-token loss per row over its real tokens: (B,), and the model's output."""
    x, y, m = ids[:, :-1], ids[:, 1:], mask[:, 1:]
    keys = mask[:, :-1]
    l = x.shape[1]
    causal = torch.ones(l, l, dtype=torch.bool, device=ids.device).tril()
    attn = (causal[None] & keys[:, None, :])[:, None]  # (B, 1, L, L)
    out = model(x, attention_mask=attn, **kw)
    ce = torch.nn.functional.cross_entropy(out.logits.float().transpose(1, 2), y, reduction="none")  # (B, L)
    return (ce * m).sum(1) / m.sum(1).clamp(min=1), out


def evaluate(model: ReasonFormerModel, skills: list[SkillData], batch: int, device: torch.device) -> dict[str, Any]:
    """Held-out loss per skill (inference mode: hard gates at the configured threshold), the router's mean
    weight per skill at step 1 and the depth chosen, per skill's data."""
    was = model.training
    model.eval()
    report: dict[str, Any] = {}
    n = model.cfg.n_skills
    try:
        with torch.no_grad():
            for sd in skills:
                losses: list[float] = []
                decisions: list[Decision] = []
                for i in range(0, len(sd.held), batch):
                    per_row, _ = row_losses(model, *sd.batch(sd.held[i: i + batch], device))
                    losses += per_row.tolist()
                    decisions += model.reports
                weights = [0.0] * n
                for d in decisions:
                    for j, w in zip(d.skills[0], d.weights[0]):
                        weights[j] += w / len(decisions)
                depth = [sum(d.depth == k for d in decisions) for k in range(1, model.cfg.max_steps + 1)]
                report[sd.name] = {"loss": sum(losses) / len(losses), "losses": losses,
                                   "router": [round(w, 4) for w in weights], "depth": depth}
    finally:
        model.train(was)
    return report


def _losses(report: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v['loss']:.3f}" for k, v in report.items())


def _open_gates(model: ReasonFormerModel, bias: float) -> None:
    with torch.no_grad():
        for gate in model.gates:
            assert isinstance(gate, StopGate)
            gate.out.bias.fill_(bias)


def train_reasonformer(base: Path | str, skills: dict[str, str], out: Path | str, tc: TrainConfig, *,
                       options: dict[str, Any] | None = None, force: bool = False,
                       log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train (retrofitting a Llama base, or continuing a ReasonFormer checkpoint) and write a checkpoint;
    ``skills`` maps each skill name to its data (``PATH`` or ``PATH@START:END``); returns the run's summary."""
    from transformers import AutoTokenizer

    tc.check()
    base = Path(base).expanduser().resolve()
    out = check_new_dir(out, force)
    if not skills:
        raise BuildError("give at least one --skill NAME=DATA")
    if is_reasonformer_dir(base):
        if options:
            raise BuildError(f"{base} is a ReasonFormer checkpoint: its settings are fixed (got {sorted(options)})")
        model = load_reasonformer(base)
        if tuple(skills) != model.cfg.skills:
            raise BuildError(f"{base} has skills {list(model.cfg.skills)}; give --skill for each, in that order "
                             f"(got {list(skills)})")
    else:
        config = read_config(base)
        cfg = ReasonFormerConfig.from_options(int(config.get("num_hidden_layers", 0)),
                                              {**(options or {}), "skills": tuple(skills)})
        cfg.base = str(base)
        torch.manual_seed(tc.seed)
        model = ReasonFormerModel(load_base_model(base), cfg)
    tok = AutoTokenizer.from_pretrained(model.cfg.base)
    data = load_skill_data(skills, tok, tc)
    device = torch.device(tc.device)
    model.to(device)
    before = evaluate(model, data, tc.batch_size, device)
    trainable = model.trainable()
    lora = [p for k, p in trainable.items() if k.startswith("lora.")]
    n_params = sum(p.numel() for p in trainable.values())
    log(f"training ReasonFormer: skills {', '.join(model.cfg.skills)} ({model.cfg.kind}), top_k {model.cfg.top_k}, "
        f"max_steps {model.cfg.max_steps}; {n_params:,} trainable parameters; "
        f"held-out loss {_losses(before)}")
    rng = random.Random(tc.seed)
    t0 = time.perf_counter()
    history: dict[str, list[float]] = {"stage1": [], "stage2": []}
    model.train()
    if tc.stage1_steps:
        for p in lora:
            p.requires_grad_(True)
        opt = torch.optim.AdamW(lora, lr=tc.lr, weight_decay=0.0)
        for j, sd in enumerate(data):
            for step in range(1, tc.stage1_steps + 1):
                rows = [sd.train[rng.randrange(len(sd.train))] for _ in range(tc.batch_size)]
                per_row, _ = row_losses(model, *sd.batch(rows, device), skill=j, open_gates=True)
                loss = per_row.mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(lora, 1.0)
                opt.step()
                history["stage1"].append(float(loss.detach()))
                if step % tc.log_every == 0 or step == tc.stage1_steps:
                    log(f"stage 1 [{sd.name}] step {step:4d}  loss {loss.item():.4f}  {time.perf_counter() - t0:.0f}s")
        _open_gates(model, 2.0)  # stage 1 trained every step in full: start stage 2 from there
    if tc.stage2_steps:
        params = list(trainable.values())
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.AdamW(params, lr=tc.lr, weight_decay=0.0)
        for step in range(1, tc.stage2_steps + 1):
            picks = [data[rng.randrange(len(data))] for _ in range(tc.batch_size)]  # every row a skill of its own
            rows = [sd.train[rng.randrange(len(sd.train))] for sd in picks]
            per_row, res = row_losses(model, *data[0].batch(rows, device))
            extra = res.gate_probs[:, 1:].cumprod(1).sum(1).mean() if res.gate_probs.shape[1] > 1 else torch.zeros(())
            loss = per_row.mean() + tc.depth_cost * extra
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            history["stage2"].append(float(per_row.mean().detach()))
            if step % tc.log_every == 0 or step == tc.stage2_steps:
                log(f"stage 2 step {step:4d}  loss {per_row.mean().item():.4f}  expected extra steps "
                    f"{float(extra.detach()):.2f}  {time.perf_counter() - t0:.0f}s")
    for p in trainable.values():
        p.requires_grad_(False)
    model.eval()
    after = evaluate(model, data, tc.batch_size, device)
    summary = {"skills": {name: spec for name, spec in skills.items()}, "trainable_parameters": n_params,
               "before": before, "after": after, "seconds": round(time.perf_counter() - t0, 1),
               "history": {k: [round(x, 4) for x in v] for k, v in history.items()}, "train": asdict(tc),
               "config": model.cfg.to_json()}
    with atomic_output(out, force) as tmp:
        save_reasonformer(model, tmp, extra={"training": {k: v for k, v in summary.items() if k != "history"}})
    log(f"held-out loss {_losses(before)} -> {_losses(after)}; "
        f"router weights at step 1 per skill's data {[v['router'] for v in after.values()]}; depth "
        f"{[v['depth'] for v in after.values()]}; saved to {out}")
    return summary


def per_rank_parameters(model: ReasonFormerModel) -> int:
    """Trainable parameters one unit of LoRA rank costs on the reasoning block's targets."""
    return sum(lora.base.in_features + lora.base.out_features for lora in model.loras)


def train_plain_lora(base: Path | str, skills: dict[str, str], out: Path | str, tc: TrainConfig, rank: int, *,
                     options: dict[str, Any] | None = None, force: bool = False,
                     log: Callable[[str], None] = print) -> dict[str, Any]:
    """The baseline: one LoRA of ``rank`` on the reasoning block of ``options``' split, trained for the same
    optimizer steps as `train_reasonformer` (``len(skills) * stage1_steps + stage2_steps``) on batches mixing
    the same skills' data; written merged into a dense checkpoint."""
    from transformers import AutoTokenizer

    tc.check()
    base = Path(base).expanduser().resolve()
    out = check_new_dir(out, force)
    config = read_config(base)
    opts = {**(options or {}), "skills": ("lora",), "kind": "private", "top_k": 1, "max_steps": 1, "rank": rank}
    cfg = ReasonFormerConfig.from_options(int(config.get("num_hidden_layers", 0)), opts)
    cfg.base = str(base)
    torch.manual_seed(tc.seed)
    model = ReasonFormerModel(load_base_model(base), cfg)
    tok = AutoTokenizer.from_pretrained(base)
    data = load_skill_data(skills, tok, tc)
    device = torch.device(tc.device)
    model.to(device)
    lora = [p for k, p in model.trainable().items() if k.startswith("lora.")]
    n_params = sum(p.numel() for p in lora)
    before = evaluate(model, data, tc.batch_size, device)
    steps = len(data) * tc.stage1_steps + tc.stage2_steps
    log(
        f"training plain LoRA rank {rank} on layers {list(cfg.block)}: {n_params:,} trainable parameters, {steps} steps"
    )
    for p in lora:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(lora, lr=tc.lr, weight_decay=0.0)
    rng = random.Random(tc.seed)
    t0 = time.perf_counter()
    model.train()
    for step in range(1, steps + 1):
        sd = data[rng.randrange(len(data))] if step > len(data) * tc.stage1_steps else \
            data[(step - 1) // max(1, tc.stage1_steps)]  # stage-1 steps see one skill's data at a time, as there
        rows = [sd.train[rng.randrange(len(sd.train))] for _ in range(tc.batch_size)]
        per_row, _ = row_losses(model, *sd.batch(rows, device))
        loss = per_row.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(lora, 1.0)
        opt.step()
        if step % tc.log_every == 0 or step == steps:
            log(f"plain LoRA step {step:4d}  loss {loss.item():.4f}  {time.perf_counter() - t0:.0f}s")
    for p in lora:
        p.requires_grad_(False)
    model.eval()
    after = evaluate(model, data, tc.batch_size, device)
    summary = {"rank": rank, "trainable_parameters": n_params, "steps": steps, "before": before,
               "after": after, "seconds": round(time.perf_counter() - t0, 1)}
    with atomic_output(out, force) as tmp:
        merge_into_base(model, tmp)
        write_manifest(tmp, {"family": "lora-merged", "base": str(base), "training": summary})
    return summary


def merge_into_base(model: ReasonFormerModel, out: Path) -> None:
    """A one-skill, one-step model's LoRA merged into the frozen weights (W += (alpha/r) B A), saved as the
    base's own architecture with its tokenizer."""
    if model.cfg.n_skills != 1 or model.cfg.max_steps != 1 or model.cfg.kind != "private":
        raise BuildError("only a one-skill, one-step private LoRA merges into a dense checkpoint")
    with torch.no_grad():
        for layer in model.block:
            for t in model.cfg.targets:
                lora = getattr(layer.self_attn, t)
                lora.base.weight += lora.scales[0] * (lora.B[0][0] @ lora.A[0][0])
                setattr(layer.self_attn, t, lora.base)
    model.base.save_pretrained(out)
    copy_tokenizer(Path(model.cfg.base), out)
