"""`chorus bench moe-train`: the MoE training evidence, one run, printed as tables.

From one dense base and one data file, with the same steps, batch and learning rate: the dense
base's MLPs fine-tuned (the baseline) and the upcycled MoE trained with each router at each expert
count (plus, with DeepSeek, a control whose selection bias is frozen: what the auxiliary-loss-free
update changes). For each result: held-out loss (mean over the held-out sequences, with a 95%
interval of the paired difference to the dense fine-tune), expert load balance over the whole run
(coefficient of variation of per-layer loads, max/min), the share of routing decisions dropped by
capacity, and decode tokens/s of serving the result on chorus's engine (best of ``--rounds``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from chorus.clients.local import markdown_table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", default=str(Path.home() / ".cache" / "chorus" / "models" / "smollm2-135m-instruct"))
    p.add_argument("--data", required=True, help="training JSONL (the first --eval-sequences packed sequences are "
                                                 "held out)")
    p.add_argument("--out-dir", required=True, help="where the trained checkpoints go (one folder per variant)")
    p.add_argument("--routers", default="switch,gshard,deepseek")
    p.add_argument("--experts", default="4,8")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--bias-speed", type=float, default=0.001)
    p.add_argument("--eval-sequences", type=int, default=32)
    p.add_argument("--no-control", action="store_true", help="skip the DeepSeek run with a frozen bias")
    p.add_argument("--reuse", action="store_true", help="measure checkpoints already in --out-dir, train the rest")
    p.add_argument("--tokens", type=int, default=64, help="decode tokens per stream when serving each result")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)


def variants(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = [("dense", {"router": "dense"})]
    counts = [int(e) for e in args.experts.split(",")]
    for router in args.routers.split(","):
        for e in counts:
            speed = {"bias_speed": args.bias_speed} if router == "deepseek" else {}
            out.append((f"{router}-{e}", {"router": router, "experts": e, **speed}))
    if "deepseek" in args.routers.split(",") and not args.no_control:
        out.append(
            (f"deepseek-{counts[0]}-frozen-bias", {"router": "deepseek", "experts": counts[0], "bias_speed": 0.0})
        )
    return out


def paired_interval(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Mean of x - y over paired items and its normal 95% interval."""
    d = [x - y for x, y in zip(xs, ys)]
    mean = statistics.fmean(d)
    se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
    return mean, mean - 1.96 * se, mean + 1.96 * se


async def decode_rates(path: Path, tokens: int, streams: int, rounds: int,
                       options: dict[str, Any] | None = None) -> dict[int, float]:
    """Decode tokens/s of the checkpoint at ``path`` on chorus's engine, at batch 1 and ``streams``, best of
    ``rounds``; ``options``: the model family's request options."""
    from chorus.engines.core.base import GenerationRequest, SamplingParams
    from chorus.engines.core.spec import ModelSpec
    from chorus.engines.transformers.engine import TransformersEngine

    engine = TransformersEngine.load(ModelSpec(name=path.name, path=str(path)))
    await engine.start()
    try:
        ids = engine.tokenizer.encode("Natalia sold clips to 48 of her friends in April, and then")
        best: dict[int, float] = {}
        for _ in range(rounds):
            for n in (1, streams):
                reqs = [GenerationRequest(ids, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True),
                                          options=dict(options or {})) for _ in range(n)]
                t0 = time.perf_counter()
                gens = await asyncio.gather(*(engine.generate(r) for r in reqs))
                rate = sum(g.completion_tokens for g in gens) / (time.perf_counter() - t0)
                best[n] = max(best.get(n, 0.0), rate)
        return best
    finally:
        await engine.aclose()


def main(args: argparse.Namespace) -> int:
    import torch

    from chorus.training.moe import MoeTrainConfig, train_moe

    torch.set_num_threads(args.threads)
    root = Path(args.out_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    summaries: dict[str, dict[str, Any]] = {}
    for name, settings in variants(args):
        out = root / name
        if args.reuse and (out / "chorus-prepared.json").is_file():
            summaries[name] = json.loads((out / "chorus-prepared.json").read_text())["training"]
            continue
        tc = MoeTrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                            eval_sequences=args.eval_sequences, log_every=max(1, args.steps // 3), **settings)
        print(f"--- {name}", flush=True)
        summaries[name] = train_moe(args.base, args.data, out, tc, force=True,
                                    log=lambda line: print(f"    {line}", flush=True))
    rates = {name: asyncio.run(decode_rates(root / name, args.tokens, args.streams, args.rounds)) for name in summaries}
    dense = summaries["dense"]
    rows = []
    for name, s in summaries.items():
        d, lo, hi = paired_interval(s["held_out_losses"], dense["held_out_losses"])
        load = s.get("load")
        rows.append(
            [
                name,
                f"{s['trainable_parameters'] / 1e6:.1f}M",
                f"{s['loss_before']:.3f}",
                f"{s['loss_after']:.3f}",
                "-" if name == "dense" else f"{d:+.3f} [{lo:+.3f}, {hi:+.3f}]",
                f"{load['cv']:.3f}" if load else "-",
                f"{load['max_min']}" if load else "-",
                f"{s['dropped_share']:.1%}" if load else "-",
                f"{s.get('aux_loss_mean', 0):.4f}" if load else "-",
                f"{s['train_tokens_per_s']:.0f}",
                f"{rates[name][1]:.1f}",
                f"{rates[name][args.streams]:.1f}",
                f"{rates[name][1] / rates['dense'][1]:.2f}x",
            ]
        )
    n_held = dense["held_out_sequences"]
    print(f"\n### MoE training from {Path(args.base).name}: {args.steps} steps x {args.batch_size} x {args.seq_len} "
          f"tokens, lr {args.lr}, {n_held} held-out sequences\n")
    print(markdown_table(["variant", "trainable", "held-out loss before", "after", "after - dense (95% CI)",
                          "load CV", "max/min", "dropped", "aux loss", "train tok/s", "decode tok/s (1)",
                          f"decode tok/s ({args.streams})", "decode vs dense"], rows))
    print("\nload CV / max/min: per-layer expert loads over all training steps (decisions before capacity), mean "
          "over layers; dropped: decisions past an expert's capacity; aux loss: the weighted auxiliary terms' mean")
    return 0
