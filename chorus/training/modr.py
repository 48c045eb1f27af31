"""Training MoDr's branches (docs/methods.md §8): ``chorus train modr``.

Only the LoRA branches and the router train (and the input-injection adapter when the run starts
from a plain Llama checkpoint, i.e. retrofitting); the base stays frozen. Each step samples a
recurrence count as Huginn does (log-normal Poisson with the given mean: ``tau ~ N(log(mean) -
sigma^2/2, sigma)``, ``r = Poisson(exp(tau)) + 1``), runs the first ``r - k`` steps without
gradients and backpropagates through the last ``k`` (truncated BPTT). After every routing round
(each recurrence step of a batch) the router bias moves without an auxiliary loss (`balance.BiasBalancer`,
the same code the MoE trainer uses): ``b_i += eta * sign(mean(c) - c_i)`` with ``c_i`` the routing
decisions of that round that went to branch i. Held-out loss at the mean recurrence is measured before and after.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from chorus.engines.families.balance import BiasBalancer, load_stats
from chorus.engines.families.checkpoint import atomic_output, check_new_dir, read_config
from chorus.engines.families.modr.checkpoint import is_modr_dir, load_base_model, load_modr, save_modr
from chorus.engines.families.modr.config import MoDrConfig
from chorus.engines.families.modr.model import MoDrModel
from chorus.errors import BuildError
from chorus.training.data import pack, read_texts


@dataclass
class TrainConfig:
    steps: int = 50
    batch_size: int = 4
    seq_len: int = 128
    lr: float = 1e-3
    mean_recurrence: float = 4.0
    sigma: float = 0.5
    bptt: int = 2
    eta: float = 0.03  # per routing round; see the README's MoDr balance table
    eval_batches: int = 2
    seed: int = 0
    device: str = "cpu"
    log_every: int = 10

    def check(self, max_recurrence: int) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.seq_len < 8:
            raise BuildError("need steps >= 1, batch size >= 1 and sequence length >= 8")
        if self.bptt < 1:
            raise BuildError(f"--bptt must be >= 1 (got {self.bptt})")
        if not 1 <= self.mean_recurrence <= max_recurrence:
            raise BuildError(f"--mean-recurrence must be between 1 and max_recurrence={max_recurrence}")


def sample_recurrence(mean: float, sigma: float, cap: int, rng: random.Random) -> int:
    tau = rng.gauss(math.log(mean) - sigma**2 / 2, sigma)
    lam = math.exp(tau)
    # Poisson by inversion (lam is small here)
    k, p, u = 0, math.exp(-lam), rng.random()
    s = p
    while u > s and k < cap:
        k += 1
        p *= lam / k
        s += p
    return max(1, min(cap, k + 1))


def lm_loss(model: MoDrModel, batch: torch.Tensor, recurrence: int, grad_steps: int | None = None) -> torch.Tensor:
    logits = model(batch[:, :-1], recurrence=recurrence, grad_steps=grad_steps).logits  # (B, T-1, V)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


def train_modr(
    base: Path | str,
    data: Path | str,
    out: Path | str,
    tc: TrainConfig,
    *,
    modr: dict[str, Any] | None = None,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train and write a MoDr checkpoint; returns the run's summary (losses, branch usage, timing)."""
    from transformers import AutoTokenizer

    base, data = Path(base).expanduser().resolve(), Path(data).expanduser()
    out = check_new_dir(out, force)
    texts = read_texts(data)
    if is_modr_dir(base):
        model = load_modr(base)
        retrofitting = False
        tok_dir = Path(model.cfg.base)
    else:
        config = read_config(base)
        cfg = MoDrConfig.from_options(int(config.get("num_hidden_layers", 0)), modr or {})
        cfg.base = str(base)
        torch.manual_seed(tc.seed)
        model = MoDrModel(load_base_model(base), cfg)
        retrofitting = True
        tok_dir = base
    tc.check(model.cfg.max_recurrence)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0
    seqs = pack([tok(t, add_special_tokens=False)["input_ids"] for t in texts], eos, tc.seq_len)
    n_eval = min(tc.eval_batches * tc.batch_size, max(1, len(seqs) // 5))
    held, train = seqs[:n_eval], seqs[n_eval:]
    device = torch.device(tc.device)
    model.to(device)
    params = list(model.branch_parameters().items())
    if not retrofitting:
        params = [(k, p) for k, p in params if k != "adapter.weight"]
    for _, p in params:
        p.requires_grad_(True)
    if not retrofitting:
        model.adapter.weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for _, p in params], lr=tc.lr, weight_decay=0.0)
    eval_r = max(1, round(tc.mean_recurrence))

    def held_loss() -> float:
        model.eval()
        with torch.no_grad():
            losses = [float(lm_loss(model, held[i: i + tc.batch_size].to(device), eval_r))
                      for i in range(0, len(held), tc.batch_size)]
        model.train()
        return sum(losses) / len(losses)

    rng = random.Random(tc.seed)
    model.balancer = BiasBalancer(model.router_bias, tc.eta)  # moves the bias after every routing round
    gen = torch.Generator().manual_seed(tc.seed)
    before = held_loss()
    log(f"training MoDr: {len(train)} sequences of {tc.seq_len} tokens, {sum(p.numel() for _, p in params):,} "
        f"trainable parameters ({'adapter, ' if retrofitting else ''}router, {model.cfg.branches} LoRA branches); "
        f"held-out loss at r={eval_r}: {before:.4f}")
    usage = [0] * model.cfg.branches
    t0 = time.perf_counter()
    model.train()
    losses = []
    for step in range(1, tc.steps + 1):
        idx = torch.randint(0, len(train), (tc.batch_size,), generator=gen)
        batch = train[idx].to(device)
        r = sample_recurrence(tc.mean_recurrence, tc.sigma, model.cfg.max_recurrence, rng)
        loss = lm_loss(model, batch, r, grad_steps=tc.bptt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in params], 1.0)
        opt.step()
        counts = [0] * model.cfg.branches
        for rep in model.reports:
            for b in rep.branches:
                counts[b] += 1
        usage = [u + c for u, c in zip(usage, counts)]
        losses.append(float(loss.detach()))
        if step % tc.log_every == 0 or step == tc.steps:
            log(f"step {step:4d}  loss {sum(losses[-tc.log_every:]) / len(losses[-tc.log_every:]):.4f}  "
                f"r={r:2d}  branches {counts}  {time.perf_counter() - t0:.0f}s")
    model.balancer = None
    after = held_loss()
    for _, p in params:
        p.requires_grad_(False)
    model.eval()
    summary = {"loss_before": round(before, 4), "loss_after": round(after, 4), "eval_recurrence": eval_r,
               "steps": tc.steps, "seconds": round(time.perf_counter() - t0, 1), "branch_usage": usage,
               "branch_balance": load_stats(usage),
               "router_bias": [round(float(b), 5) for b in model.router_bias], "data": str(data),
               "retrofit": retrofitting, "train": asdict(tc)}
    with atomic_output(out, force) as tmp:
        save_modr(model, tmp, extra={"training": summary})
    log(f"held-out loss at r={eval_r}: {before:.4f} -> {after:.4f}; branch usage {usage}; saved to {out}")
    return summary
