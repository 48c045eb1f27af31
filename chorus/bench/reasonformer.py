"""`chorus bench reasonformer`: the ReasonFormer evidence, one run, printed as tables.

From one base (SmolLM2-135M-Instruct) and the same data and optimizer steps:

* ``reasonformer``: `chorus train reasonformer` on four skills (math: GSM8K train; science: ARC-Easy
  train; commonsense: the first half of PIQA validation, the second half held out; general:
  HellaSwag validation rows, as plain text), stage 1 then stage 2;
* ``plain LoRA``: one LoRA on the same reasoning block, rank chosen for the same number of trainable
  parameters, trained for as many steps on the same skills' data (merged into a dense checkpoint);
* ``base``: the model both start from (a fresh retrofit at the default threshold is exactly it).

Tables: held-out loss per task (each skill's last ``--eval-rows`` rows; 95% intervals of the paired
differences), multiple-choice accuracy through a live chorus server's ``/v1/choices`` on held-out PIQA
(second half of validation) and ARC-Easy test (Wilson intervals; paired bootstrap intervals of the
differences), the router's mean step-1 weight per skill on each task's held-out rows, the depth the
stop gate chose per task, and decode tokens/s (best of ``--rounds``) of each model on chorus's engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from pathlib import Path
from typing import Any

from chorus.bench.moe_train import decode_rates, paired_interval
from chorus.clients.local import markdown_table

PIQA_SPLIT = 918  # PIQA validation rows [0, 918) train the commonsense skill, [918, 1838) are held out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", default=str(Path.home() / ".cache" / "chorus" / "models" / "smollm2-135m-instruct"))
    p.add_argument("--data-dir", required=True, help="folder with gsm8k/, arc-easy/, piqa/, hellaswag/ (JSONL)")
    p.add_argument("--out-dir", required=True, help="where the two trained checkpoints go")
    p.add_argument("--stage1-steps", type=int, default=20, help="per skill")
    p.add_argument("--stage2-steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-rows", type=int, default=48, help="held-out rows per task for the loss")
    p.add_argument("--mc-items", type=int, default=200, help="held-out PIQA and ARC-Easy items scored")
    p.add_argument("--tokens", type=int, default=48, help="decode tokens per stream")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reuse", action="store_true", help="measure checkpoints already in --out-dir, train the rest")


def skills(data: Path) -> dict[str, str]:
    return {"math": str(data / "gsm8k" / "train.jsonl"), "science": str(data / "arc-easy" / "train.jsonl"),
            "commonsense": f"{data / 'piqa' / 'validation.jsonl'}@:{PIQA_SPLIT}",
            "general": f"{data / 'hellaswag' / 'validation.jsonl'}@:3000"}


def serve(models: dict[str, Path], work: Path) -> tuple[str, Any]:
    """``chorus serve`` in a child process on a free 127.0.0.1 port, serving ``models`` (name -> checkpoint
    directory); returns its URL and the function that stops it."""
    import socket
    import subprocess
    import sys

    import httpx
    import yaml

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = work / "bench-reasonformer.yaml"
    config.write_text(yaml.safe_dump({"models": [{"name": n, "path": str(p)} for n, p in models.items()],
                                      "server": {"host": "127.0.0.1", "port": port}}))
    server_log = (work / "bench-reasonformer-server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "chorus", "serve", "--config", str(config)], stdout=server_log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            server_log.close()
            raise RuntimeError(f"chorus serve did not come up on {url} (its log: {server_log.name})")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        server_log.close()

    return url, stop


async def choices(url: str, models: list[str], sets: dict[str, Path], offsets: dict[str, int], n: int) -> dict:
    """Per set and model: 0/1 correct per item (``sum`` normalisation: lm-eval's acc; ``char``: acc_norm)."""
    import httpx
    import numpy as np

    from chorus.clients.eval_choices import load_items, run_system

    out: dict[str, dict[str, dict[str, Any]]] = {}
    async with httpx.AsyncClient(base_url=url + "/v1", timeout=600) as http:
        for name, path in sets.items():
            items = load_items(path, offsets[name], n)
            gold = np.array([it.label for it in items])
            out[name] = {}
            for model in models:
                scored = await run_system(http, model, {"model": model}, items, None, 2)
                out[name][model] = {norm: scored.correct(norm, gold) for norm in ("sum", "char")}
    return out


def main(args: argparse.Namespace) -> int:
    import torch

    from chorus import stats as S
    from chorus.engines.families.reasonformer import load_reasonformer
    from chorus.training.reasonformer import (
        TrainConfig,
        per_rank_parameters,
        train_plain_lora,
        train_reasonformer,
    )

    torch.set_num_threads(args.threads)
    data, root = Path(args.data_dir).expanduser(), Path(args.out_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    tc = TrainConfig(stage1_steps=args.stage1_steps, stage2_steps=args.stage2_steps, batch_size=args.batch_size,
                     seq_len=args.seq_len, lr=args.lr, eval_rows=args.eval_rows, log_every=10)
    sk = skills(data)
    rf_dir, lora_dir = root / "reasonformer", root / "plain-lora"

    def log(line: str) -> None:
        print(f"    {line}", flush=True)

    def done(path: Path) -> dict[str, Any] | None:
        manifest = path / "chorus-prepared.json"
        if args.reuse and manifest.is_file():
            m = json.loads(manifest.read_text())
            return m.get("training") or json.loads((path / "config.json").read_text()).get("training")
        return None

    rf = done(rf_dir) or train_reasonformer(args.base, sk, rf_dir, tc, force=True, log=log)
    if "trainable_parameters" not in rf:
        rf = json.loads((rf_dir / "config.json").read_text())["training"]
    model = load_reasonformer(rf_dir)
    rank = max(1, round(rf["trainable_parameters"] / per_rank_parameters(model)))
    cfg = model.cfg
    del model
    split = {k: list(getattr(cfg, k)) for k in ("representation", "block", "coda")}
    lora = done(lora_dir) or train_plain_lora(args.base, sk, lora_dir, tc, rank, options=split, force=True, log=log)

    # held-out loss per task
    rows = []
    for task in sk:
        base_l, lora_l, rf_l = (
            rf["before"][task]["losses"],
            lora["after"][task]["losses"],
            rf["after"][task]["losses"],
        )
        d, lo, hi = paired_interval(rf_l, lora_l)
        db, lob, hib = paired_interval(rf_l, base_l)
        rows.append([task, len(rf_l), f"{sum(base_l) / len(base_l):.3f}", f"{sum(lora_l) / len(lora_l):.3f}",
                     f"{sum(rf_l) / len(rf_l):.3f}", f"{d:+.3f} [{lo:+.3f}, {hi:+.3f}]",
                     f"{db:+.3f} [{lob:+.3f}, {hib:+.3f}]"])
    steps = len(sk) * args.stage1_steps + args.stage2_steps
    print(f"\n### ReasonFormer vs plain LoRA from {Path(args.base).name}: {steps} optimizer steps each "
          f"({args.stage1_steps} per skill + {args.stage2_steps} joint) x {args.batch_size} examples of <= "
          f"{args.seq_len} tokens, lr {args.lr}; ReasonFormer {rf['trainable_parameters']:,} trainable parameters, "
          f"plain LoRA rank {rank} on layers {split['block']} = {lora['trainable_parameters']:,}; training took "
          f"{rf['seconds']:.0f} s and {lora['seconds']:.0f} s on {args.threads} CPU threads\n")
    print(markdown_table(["held-out task", "rows", "base loss", "plain LoRA", "ReasonFormer",
                          "ReasonFormer - LoRA (95% CI)", "ReasonFormer - base (95% CI)"], rows))

    # router weights and depth per task
    names = list(cfg.skills)
    rows = [[task, *[f"{w:.2f}" for w in rf["after"][task]["router"]],
             " / ".join(str(c) for c in rf["after"][task]["depth"])] for task in sk]
    print(f"\n### Router weight per skill at step 1 (mean over each task's held-out rows, top-{cfg.top_k}) and the "
          f"depth the stop gate chose (rows at depth 1 / 2 / ... / {cfg.max_steps}, threshold {cfg.stop_threshold})\n")
    print(markdown_table(["task's data", *names, "depth"], rows))

    # multiple-choice accuracy through /v1/choices
    models = {"base": Path(args.base), "plain-lora": lora_dir, "reasonformer": rf_dir}
    url, stop = serve(models, root)
    try:
        sets = {
            "PIQA (held-out half)": data / "piqa" / "validation.jsonl",
            "ARC-Easy test": data / "arc-easy" / "test.jsonl",
        }
        offsets = {"PIQA (held-out half)": PIQA_SPLIT, "ARC-Easy test": 0}
        t0 = time.perf_counter()
        acc = asyncio.run(choices(url, list(models), sets, offsets, args.mc_items))
        mc_seconds = time.perf_counter() - t0
    finally:
        stop()
    rows = []
    for name, by_model in acc.items():
        for norm in ("sum", "char"):
            cells = [name, "acc" if norm == "sum" else "acc_norm"]
            for m in models:
                c = by_model[m][norm]
                lo, hi = S.accuracy_interval(c)
                cells.append(f"{c.mean():.3f} [{lo:.3f}, {hi:.3f}]")
            diff = S.paired_difference(by_model["reasonformer"][norm], by_model["plain-lora"][norm])
            cells.append(f"{diff.delta:+.3f} [{diff.low:+.3f}, {diff.high:+.3f}]")
            rows.append(cells)
    print(f"\n### Multiple-choice accuracy through /v1/choices ({args.mc_items} items per set, {mc_seconds:.0f} s; "
          f"Wilson 95% intervals; the difference's interval is a paired bootstrap)\n")
    print(markdown_table(["set", "metric", "base", "plain LoRA", "ReasonFormer", "ReasonFormer - LoRA"], rows))

    # decode speed
    rates = {"base": asyncio.run(decode_rates(Path(args.base), args.tokens, 1, args.rounds)),
             "plain LoRA (merged)": asyncio.run(decode_rates(lora_dir, args.tokens, 1, args.rounds)),
             "ReasonFormer (gate decides)": asyncio.run(decode_rates(rf_dir, args.tokens, 1, args.rounds)),
             f"ReasonFormer (all {cfg.max_steps} steps)": asyncio.run(
                 decode_rates(rf_dir, args.tokens, 1, args.rounds, options={"stop_threshold": 0.0}))}
    base_rate = rates["base"][1]
    print(f"\n### Decode tokens/s, batch 1, {args.tokens} tokens, best of {args.rounds}\n")
    print(markdown_table(["model", "tok/s", "vs base"],
                         [[m, f"{r[1]:.1f}", f"{r[1] / base_rate:.2f}x"] for m, r in rates.items()]))
    if not math.isfinite(base_rate):
        return 1
    return 0
