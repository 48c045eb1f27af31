"""``chorus upcycle``, ``chorus graft``, ``chorus train modr``, ``chorus train moe``, ``chorus train duma`` and
``chorus train reasonformer``: building model-family checkpoints."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def _range(text: str) -> tuple[int, int]:
    try:
        a, b = text.split(":")
        return int(a), int(b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:END (half-open layer range), got {text!r}") from None


def _fail(exc: Exception) -> int:
    print(f"chorus: {exc}", file=sys.stderr)
    return 2


def upcycle(args: argparse.Namespace) -> int:
    from chorus.engines.families.moe import UpcycleConfig
    from chorus.engines.families.moe import upcycle as build
    from chorus.errors import BuildError

    try:
        build(args.base, args.out, UpcycleConfig(experts=args.experts, top_k=args.top_k,
                                                   shared_expert=args.shared_expert, router=args.router,
                                                   layout=args.layout, noise=args.noise, seed=args.seed),
              force=args.force)
    except BuildError as exc:
        return _fail(exc)
    return 0


def graft(args: argparse.Namespace) -> int:
    from chorus.engines.families.graft import GraftConfig
    from chorus.engines.families.graft import graft as build
    from chorus.errors import BuildError

    try:
        build(args.base, args.out, GraftConfig(drop=args.drop), force=args.force)
    except BuildError as exc:
        return _fail(exc)
    return 0


def train_modr(args: argparse.Namespace) -> int:
    from chorus.errors import BuildError
    from chorus.training.modr import TrainConfig
    from chorus.training.modr import train_modr as train

    modr: dict[str, Any] = {"branches": args.branches, "rank": args.rank, "alpha": args.alpha}
    modr.update({k: getattr(args, k) for k in ("prelude", "core", "coda") if getattr(args, k) is not None})
    if args.max_recurrence is not None:
        modr["max_recurrence"] = args.max_recurrence
    tc = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                     mean_recurrence=args.mean_recurrence, bptt=args.bptt, eta=args.eta, seed=args.seed,
                     device=args.device, log_every=args.log_every)
    try:
        train(args.base, args.data, args.out, tc, modr=modr, force=args.force)
    except BuildError as exc:
        return _fail(exc)
    return 0


def upcycle_arguments(u: argparse.ArgumentParser) -> None:
    u.add_argument("--base", required=True, help="dense Llama-architecture checkpoint directory")
    u.add_argument("--experts", type=int, required=True)
    u.add_argument("--top-k", type=int, required=True)
    u.add_argument("--layout", choices=["mixtral", "qwen2_moe", "deepseek_v3"], default="mixtral",
                   help="mixtral; qwen2_moe (a gated shared expert); deepseek_v3 (DeepSeek-V3 MoE blocks: sigmoid "
                        "router with a selection bias, a shared expert; written as Glm4MoeForCausalLM)")
    u.add_argument("--shared-expert", action="store_true", help="the same as --layout qwen2_moe")
    u.add_argument("--router", choices=["random", "hidden"], default="random",
                   help="router init: random, or the principal directions of each layer's MLP inputs")
    u.add_argument("--noise", type=float, default=0.0, help="perturb each expert copy by noise * std(W)")
    u.add_argument("--seed", type=int, default=0)
    u.add_argument("--out", required=True)
    u.add_argument("--force", action="store_true", help="replace an existing output directory")


def graft_arguments(g: argparse.ArgumentParser) -> None:
    g.add_argument("--base", required=True)
    g.add_argument("--drop", type=int, required=True, help="M: layers dropped at the seam from each copy")
    g.add_argument("--out", required=True)
    g.add_argument("--force", action="store_true")


def train_modr_arguments(m: argparse.ArgumentParser) -> None:
    m.add_argument("--base", required=True, help="Llama checkpoint (retrofit) or MoDr checkpoint directory")
    m.add_argument("--data", required=True, help="JSONL: text | prompt+completion | question+answer | messages")
    m.add_argument("--out", required=True)
    m.add_argument("--steps", type=int, default=50)
    m.add_argument("--batch-size", type=int, default=4)
    m.add_argument("--seq-len", type=int, default=128)
    m.add_argument("--lr", type=float, default=1e-3)
    m.add_argument("--mean-recurrence", type=float, default=4.0, help="Huginn trains with 32 (GPU)")
    m.add_argument("--bptt", type=int, default=2, help="backpropagate through the last k steps (Huginn: 8)")
    m.add_argument("--eta", type=float, default=0.03,
                   help="router bias step per routing round (0 lets the routing collapse; 0.001 balanced nothing "
                        "in 20 steps)")
    m.add_argument("--branches", type=int, default=4)
    m.add_argument("--rank", type=int, default=16)
    m.add_argument("--alpha", type=float, default=16.0)
    m.add_argument("--prelude", type=_range, help="START:END of the base's layers (retrofit)")
    m.add_argument("--core", type=_range)
    m.add_argument("--coda", type=_range)
    m.add_argument("--max-recurrence", type=int)
    m.add_argument("--device", default="cpu")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--log-every", type=int, default=10)
    m.add_argument("--force", action="store_true")


def train_moe(args: argparse.Namespace) -> int:
    from chorus.errors import BuildError
    from chorus.training.moe import MoeTrainConfig
    from chorus.training.moe import train_moe as train

    tc = MoeTrainConfig(router=args.router, experts=args.experts, top_k=args.top_k, noise=args.noise, steps=args.steps,
                        batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                        capacity_factor=args.capacity, aux_weight=args.aux_weight, z_weight=args.z_weight,
                        jitter=args.jitter, bias_speed=args.bias_speed, eval_sequences=args.eval_sequences,
                        seed=args.seed, device=args.device, log_every=args.log_every)
    try:
        train(args.base, args.data, args.out, tc, force=args.force)
    except BuildError as exc:
        return _fail(exc)
    return 0


def train_moe_arguments(m: argparse.ArgumentParser) -> None:
    m.add_argument("--base", required=True, help="dense Llama checkpoint (upcycled first) or an MoE checkpoint "
                                                 "(Mixtral, Qwen2-MoE, DeepSeek-V3 layout)")
    m.add_argument("--data", required=True, help="JSONL: text | prompt+completion | question+answer | messages")
    m.add_argument("--router", required=True, choices=["switch", "gshard", "deepseek", "dense"],
                   help="switch: top-1 + capacity; gshard: top-2 + random second expert; deepseek: sigmoid top-k + "
                        "shared expert, auxiliary-loss-free bias; dense: fine-tune the dense base's MLPs (baseline)")
    m.add_argument("--out", required=True)
    m.add_argument("--experts", type=int, help="experts when upcycling a dense base (default 4)")
    m.add_argument("--top-k", type=int, help="DeepSeek's experts per token (default 2; Switch: 1, GShard: 2)")
    m.add_argument("--noise", type=float, help="upcycling noise on the expert copies, x std(W) (default 0.01)")
    m.add_argument("--steps", type=int, default=50)
    m.add_argument("--batch-size", type=int, default=4)
    m.add_argument("--seq-len", type=int, default=128)
    m.add_argument("--lr", type=float, default=1e-4)
    m.add_argument("--capacity", type=float, help="capacity factor (Switch, GShard; default 1.25)")
    m.add_argument("--aux-weight", type=float, help="auxiliary balance loss weight (default 0.01; DeepSeek: 0)")
    m.add_argument("--z-weight", type=float, help="router z-loss weight (Switch, GShard; default 0.001)")
    m.add_argument("--jitter", type=float, help="multiplicative router-input noise (Switch; default 0)")
    m.add_argument("--bias-speed", type=float, help="DeepSeek's selection-bias step per batch (default 0.001)")
    m.add_argument("--eval-sequences", type=int, default=8, help="packed sequences held out for the loss")
    m.add_argument("--device", default="cpu", help="cpu or cuda")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--log-every", type=int, default=10)
    m.add_argument("--force", action="store_true")


def train_duma(args: argparse.Namespace) -> int:
    from chorus.engines.families.duma import DumaConfig
    from chorus.errors import BuildError
    from chorus.training.duma import TrainConfig
    from chorus.training.duma import train_duma as train

    cfg = DumaConfig(head=args.head, fuse=args.fuse, heads=args.heads, dropout=args.dropout, max_length=args.max_length)
    tc = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, head_lr=args.head_lr,
                     evals_per_epoch=args.evals_per_epoch, seed=args.seed, device=args.device, log_every=args.log_every)
    try:
        train(args.data, args.out, cfg, tc, dev=args.dev, encoder=args.encoder, force=args.force)
    except BuildError as exc:
        return _fail(exc)
    return 0


def train_duma_arguments(d: argparse.ArgumentParser) -> None:
    from chorus.engines.families.duma import FUSES, HEADS

    d.add_argument("--data", required=True, help="multiple-choice JSONL: choices, label, question | goal | context")
    d.add_argument("--dev", help="dev JSONL for checkpoint selection (default: 10%% of --data held out)")
    d.add_argument("--out", required=True)
    d.add_argument("--encoder", default="minilm", help="'minilm' (all-MiniLM-L6-v2, packaged) or an encoder directory")
    d.add_argument("--head", choices=HEADS, default="duma", help="duma: co-attention; baseline: mean-pool + linear")
    d.add_argument("--fuse", choices=FUSES, default="cat", help="how the two co-attention outputs combine")
    d.add_argument("--heads", type=int, help="co-attention heads (default: the encoder's)")
    d.add_argument("--dropout", type=float, default=0.1)
    d.add_argument("--epochs", type=int, default=2)
    d.add_argument("--batch-size", type=int, default=8, help="items per step (each with all its options)")
    d.add_argument("--lr", type=float, default=5e-5, help="the encoder's learning rate")
    d.add_argument("--head-lr", type=float, default=1e-3)
    d.add_argument("--max-length", type=int, default=128, help="tokens per (prompt, option) pair")
    d.add_argument("--evals-per-epoch", type=int, default=2)
    d.add_argument("--device", default="cpu")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--log-every", type=int, default=50)
    d.add_argument("--force", action="store_true")


def _skill(text: str) -> tuple[str, str]:
    name, sep, data = text.partition("=")
    if not sep or not name or not data:
        raise argparse.ArgumentTypeError(f"expected NAME=DATA (DATA: a JSONL file, or FILE@START:END), got {text!r}")
    return name, data


def train_reasonformer(args: argparse.Namespace) -> int:
    from chorus.errors import BuildError
    from chorus.training.reasonformer import TrainConfig
    from chorus.training.reasonformer import train_reasonformer as train

    skills = dict(args.skill)
    if len(skills) != len(args.skill):
        return _fail(BuildError(f"a skill is named twice in --skill {[n for n, _ in args.skill]}"))
    options: dict[str, Any] = {k: getattr(args, k) for k in ("representation", "block", "coda", "kind", "rank",
                                                              "adapter_rank", "alpha", "max_steps", "stop_threshold")
                               if getattr(args, k) is not None}
    if args.top_k is not None:
        options["top_k"] = None if args.top_k == 0 else args.top_k
    tc = TrainConfig(stage1_steps=args.stage1_steps, stage2_steps=args.stage2_steps, batch_size=args.batch_size,
                     seq_len=args.seq_len, lr=args.lr, depth_cost=args.depth_cost, eval_rows=args.eval_rows,
                     seed=args.seed, device=args.device, log_every=args.log_every)
    try:
        train(args.base, skills, args.out, tc, options=options, force=args.force)
    except BuildError as exc:
        return _fail(exc)
    return 0


def train_reasonformer_arguments(r: argparse.ArgumentParser) -> None:
    r.add_argument("--base", required=True, help="Llama checkpoint (retrofit) or ReasonFormer checkpoint directory")
    r.add_argument("--skill", type=_skill, action="append", required=True, metavar="NAME=DATA",
                   help="a skill and its data, once per skill in order: JSONL (text | question+answer | "
                        "multiple-choice rows, read as their right answer), or FILE@START:END for a slice of its rows")
    r.add_argument("--out", required=True)
    r.add_argument("--stage1-steps", type=int, default=30, help="skill pre-training steps per skill (0: skip)")
    r.add_argument("--stage2-steps", type=int, default=60, help="joint fine-tuning steps (0: skip)")
    r.add_argument("--batch-size", type=int, default=4)
    r.add_argument("--seq-len", type=int, default=128, help="tokens per example (longer ones are cut)")
    r.add_argument("--lr", type=float, default=1e-3)
    r.add_argument("--depth-cost", type=float, default=0.01, help="loss per expected extra reasoning step")
    r.add_argument("--eval-rows", type=int, default=16, help="rows held out at the end of each skill's data")
    r.add_argument("--representation", type=_range, help="START:END of the base's layers (retrofit; default: the "
                                                          "first 2/5)")
    r.add_argument("--block", type=_range, help="START:END: the reasoning block (default: the next 1/5)")
    r.add_argument("--coda", type=_range)
    r.add_argument("--kind", choices=["shared", "private"], help="shared: a LoRA per skill + step adapters; "
                                                                 "private: a LoRA per (skill, step) (default shared)")
    r.add_argument("--rank", type=int, help="skill LoRA rank (default 8)")
    r.add_argument("--adapter-rank", type=int, help="shared modules' step-adapter rank (default 4)")
    r.add_argument("--alpha", type=float, help="LoRA alpha (default 16)")
    r.add_argument("--top-k", type=int, help="skills run per step (default 2; 0: all)")
    r.add_argument("--max-steps", type=int, help="reasoning steps (default 3)")
    r.add_argument("--stop-threshold", type=float, help="served default (default 0.5)")
    r.add_argument("--device", default="cpu")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--log-every", type=int, default=10)
    r.add_argument("--force", action="store_true")
