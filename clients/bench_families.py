"""`chorus bench families`: the model families' costs, printed as tables (one run, ratios in the same run).

1. MoDr decode tokens/s with routed branches vs the same recurrence count without branches (the
   plain recurrent core: no router, no LoRA), on chorus's engine.
2. MoDr decode with the per-step KV cache vs recomputing the whole sequence for every token, to
   ``--tokens`` tokens (model level, batch 1, greedy).
3. The upcycled MoE vs its dense base: decode tokens/s on chorus's engine (1 stream and
   ``--concurrency`` streams), and the expert load balance the trace reports.

Each figure is the best of ``--rounds`` rounds (a shared, noisy machine: the best round is the least
disturbed one).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from clients.local import markdown_table

PROMPT = "Write a long story about a dragon who learns to sing."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dense", default="smollm2-135m-instruct")
    p.add_argument("--moe", default="smollm2-moe")
    p.add_argument("--modr", default="smollm2-modr")
    p.add_argument("--recurrence", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)


async def _decode_rate(engine: Any, tokens: int, streams: int, options: dict[str, Any] | None = None,
                       trace: bool = False) -> tuple[float, dict[str, Any]]:
    from engines.base import GenerationRequest, SamplingParams

    ids = engine.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    traces = [{} if trace else None for _ in range(streams)]
    reqs = [GenerationRequest(ids, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True),
                              options=options or {}, trace=t) for t in traces]
    t0 = time.perf_counter()
    gens = await asyncio.gather(*(engine.generate(r) for r in reqs))
    dt = time.perf_counter() - t0
    return sum(g.completion_tokens for g in gens) / dt, traces[0] or {}


def _modr_cache_vs_recompute(model: Any, tokens: int, recurrence: int, rounds: int) -> tuple[float, float]:
    import torch

    from engines.batching import GrowingCache

    prompt = torch.tensor([[1, 504, 3458, 282, 4649, 314, 17, 18]])
    new = tokens - prompt.shape[1]

    @torch.inference_mode()
    def cached() -> float:
        cache, t0 = GrowingCache(), time.perf_counter()
        out = model(prompt, cache=cache, recurrence=recurrence)
        n = prompt.shape[1]
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(new):
            mask = torch.ones(1, 1, 1, n + 1, dtype=torch.bool)
            out = model(tok, attention_mask=mask, position_ids=torch.tensor([[n]]), cache=cache, recurrence=recurrence)
            n += 1
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
        return new / (time.perf_counter() - t0)

    @torch.inference_mode()
    def recompute() -> float:
        seq, t0 = prompt, time.perf_counter()
        for _ in range(new):
            tok = model(seq, recurrence=recurrence, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, tok], 1)
        return new / (time.perf_counter() - t0)

    return max(cached() for _ in range(rounds)), max(recompute() for _ in range(max(1, rounds - 1)))


def run(args: argparse.Namespace) -> int:
    import torch

    from engines.transformers_engine import TransformersEngine
    from server.config import load_config

    torch.set_num_threads(args.threads)
    config = load_config(args.config)

    async def main() -> None:
        modr = TransformersEngine.load(config.model(args.modr))
        await modr.start()
        opts = {"recurrence": args.recurrence}
        rows, best = [], {}
        for _ in range(args.rounds):  # rounds interleaved: both variants see the same machine noise
            for routed in (False, True):
                modr.model.use_branches = routed
                rate, _ = await _decode_rate(modr, args.tokens, 1, opts)
                best[routed] = max(best.get(routed, 0.0), rate)
        modr.model.use_branches = True
        rows.append(["MoDr, no branches (plain recurrent core)", args.recurrence, f"{best[False]:.1f}", "1.00x"])
        rows.append([f"MoDr, {modr.model.cfg.branches} routed LoRA branches", args.recurrence, f"{best[True]:.1f}",
                     f"{best[True] / best[False]:.2f}x"])
        print(f"\n### MoDr routing overhead ({args.modr}, batch 1, {args.tokens} tokens, best of {args.rounds})\n")
        print(markdown_table(["variant", "recurrence", "decode tok/s", "vs no branches"], rows))
        overhead = 1 - best[True] / best[False]
        print(f"\nrouting overhead: {overhead * 100:.1f}% (goal <= 5%)")

        cached, recomputed = _modr_cache_vs_recompute(modr.model, args.tokens, args.recurrence, args.rounds)
        print(f"\n### MoDr KV cache vs recomputation (to {args.tokens} tokens, recurrence {args.recurrence})\n")
        print(markdown_table(["decode", "tok/s", "speed-up"], [
            ["recompute the whole sequence per token", f"{recomputed:.2f}", "1.0x"],
            ["per-step KV cache (chorus)", f"{cached:.1f}", f"{cached / recomputed:.1f}x"]]))
        await modr.aclose()

        dense = TransformersEngine.load(config.model(args.dense))
        moe = TransformersEngine.load(config.model(args.moe))
        await dense.start()
        await moe.start()
        rates: dict[tuple[str, int], float] = {}
        trace: dict[str, Any] = {}
        for _ in range(args.rounds):
            for name, eng in (("dense", dense), ("moe", moe)):
                for streams in (1, args.concurrency):
                    rate, t = await _decode_rate(eng, args.tokens, streams, trace=name == "moe" and streams == 1)
                    rates[(name, streams)] = max(rates.get((name, streams), 0.0), rate)
                    trace = t or trace
        print(f"\n### Upcycled MoE vs its dense base ({args.moe}: {moe.observer.experts} experts, top-"
              f"{moe.observer.top_k}; {args.tokens} tokens per stream)\n")
        rows = []
        for streams in (1, args.concurrency):
            d, m = rates[("dense", streams)], rates[("moe", streams)]
            rows.append([streams, f"{d:.1f}", f"{m:.1f}", f"{m / d:.2f}x"])
        print(markdown_table(["streams", "dense tok/s", "MoE tok/s", "MoE / dense"], rows))
        load = trace.get("experts", {})
        counts = torch.tensor(load.get("tokens_per_expert", [[0]]), dtype=torch.float)
        share = (counts / counts.sum(1, keepdim=True).clamp(min=1)).mean(0)
        print(f"\nexpert load (one request, {counts.shape[0]} layers): mean share per expert "
              f"{', '.join(f'{x:.3f}' for x in share.tolist())}; balance (mean min/max per layer) "
              f"{load.get('balance', 0):.3f}; total since start-up per expert "
              f"{moe.observer.totals.sum(0).tolist()}")
        await dense.aclose()
        await moe.aclose()

    asyncio.run(main())
    return 0
