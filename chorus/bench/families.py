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
import statistics
import time
from typing import Any

from chorus.clients.local import markdown_table

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
    from chorus.engines.core.base import GenerationRequest, SamplingParams

    ids = engine.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    traces: list[dict[str, Any] | None] = [{} if trace else None for _ in range(streams)]
    reqs = [GenerationRequest(ids, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True),
                              options=options or {}, trace=t) for t in traces]
    t0 = time.perf_counter()
    gens = await asyncio.gather(*(engine.generate(r) for r in reqs))
    dt = time.perf_counter() - t0
    return sum(g.completion_tokens for g in gens) / dt, traces[0] or {}


def _modr_cache_vs_recompute(model: Any, context: int, batch: int, recurrence: int, steps: int,
                              rounds: int) -> tuple[float, float]:
    """Seconds per decode step for ``batch`` sequences at ``context`` tokens: with the per-step KV cache
    vs recomputing every sequence from scratch (the best of ``rounds``)."""
    import torch

    from chorus.engines.runtime.kv_cache import GrowingCache

    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 40000, (batch, context - steps), generator=gen)

    @torch.inference_mode()
    def cached() -> float:
        cache = GrowingCache()
        out = model(prompt, cache=cache, recurrence=recurrence, logits_to_keep=1)
        n = prompt.shape[1]
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for _ in range(steps):
            mask = torch.ones(batch, 1, 1, n + 1, dtype=torch.bool)
            pos = torch.full((batch, 1), n)
            out = model(tok, attention_mask=mask, position_ids=pos, cache=cache, recurrence=recurrence)
            n += 1
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
        return (time.perf_counter() - t0) / steps

    @torch.inference_mode()
    def recompute() -> float:
        seq = prompt
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = model(seq, recurrence=recurrence, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, tok], 1)
        return (time.perf_counter() - t0) / steps

    return min(cached() for _ in range(rounds)), min(recompute() for _ in range(rounds))


async def _routing_overhead(engine: Any, tokens: int, recurrence: int, rounds: int) -> dict[bool, list[float]]:
    """Decode tok/s with and without branches, rounds interleaved (both variants see the same noise)."""
    out: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for routed in (False, True):
            engine.model.use_branches = routed
            rate, _ = await _decode_rate(engine, tokens, 1, {"recurrence": recurrence})
            out[routed].append(rate)
    engine.model.use_branches = True
    return out


def main(args: argparse.Namespace) -> int:
    import torch

    from chorus.config import load_config
    from chorus.engines.families.moe import ExpertLoad
    from chorus.engines.transformers.engine import TransformersEngine

    torch.set_num_threads(args.threads)
    config = load_config(args.config)

    async def measure() -> None:
        modr = TransformersEngine.load(config.model(args.modr))
        await modr.start()
        rates = await _routing_overhead(modr, 32, args.recurrence, max(6, 3 * args.rounds))
        best = {k: max(v) for k, v in rates.items()}
        med = {k: statistics.median(v) for k, v in rates.items()}
        print(
            f"\n### MoDr routing overhead ({args.modr}, batch 1, 32-token runs, "
            f"{len(rates[True])} interleaved rounds)\n"
        )
        print(markdown_table(["variant", "recurrence", "best tok/s", "median tok/s", "best vs no branches"], [
            ["no branches (plain recurrent core)", args.recurrence, f"{best[False]:.2f}", f"{med[False]:.2f}", "1.00x"],
            [f"{modr.model.cfg.branches} routed LoRA branches (rank {modr.model.cfg.rank})", args.recurrence,
             f"{best[True]:.2f}", f"{med[True]:.2f}", f"{best[True] / best[False]:.3f}x"]]))
        print(f"\nrouting overhead: {(1 - best[True] / best[False]) * 100:.1f}% best-to-best, "
              f"{(1 - med[True] / med[False]) * 100:.1f}% median-to-median (goal <= 5%)")

        rows = []
        for batch in (1, args.concurrency):
            c, r = _modr_cache_vs_recompute(modr.model, args.tokens, batch, args.recurrence, 4, args.rounds)
            rows.append([batch, f"{r * 1000:.0f}", f"{c * 1000:.0f}", f"{r / c:.1f}x"])
        print(f"\n### MoDr decode step at {args.tokens} tokens of context: KV cache vs recomputation "
              f"(recurrence {args.recurrence})\n")
        print(markdown_table(["sequences", "recompute ms/step", "KV cache ms/step", "speed-up"], rows))
        await modr.aclose()

        dense = TransformersEngine.load(config.model(args.dense))
        moe = TransformersEngine.load(config.model(args.moe))
        await dense.start()
        await moe.start()
        decode: dict[tuple[str, int], float] = {}
        trace: dict[str, Any] = {}
        for _ in range(args.rounds):
            for name, eng in (("dense", dense), ("moe", moe)):
                for streams in (1, args.concurrency):
                    rate, t = await _decode_rate(eng, args.tokens, streams, trace=name == "moe" and streams == 1)
                    decode[(name, streams)] = max(decode.get((name, streams), 0.0), rate)
                    trace = t or trace
        load_obs = moe.observer
        assert isinstance(load_obs, ExpertLoad), f"{args.moe} is not an MoE model"
        print(f"\n### Upcycled MoE vs its dense base ({args.moe}: {load_obs.experts} experts, top-"
              f"{load_obs.top_k}; {args.tokens} tokens per stream)\n")
        rows = []
        for streams in (1, args.concurrency):
            d, m = decode[("dense", streams)], decode[("moe", streams)]
            rows.append([streams, f"{d:.1f}", f"{m:.1f}", f"{m / d:.2f}x"])
        print(markdown_table(["streams", "dense tok/s", "MoE tok/s", "MoE / dense"], rows))
        load = trace.get("experts", {})
        counts = torch.tensor(load.get("tokens_per_expert", [[0]]), dtype=torch.float)
        share = (counts / counts.sum(1, keepdim=True).clamp(min=1)).mean(0)
        print(f"\nexpert load (one request, {counts.shape[0]} layers): mean share per expert "
              f"{', '.join(f'{x:.3f}' for x in share.tolist())}; balance (mean min/max per layer) "
              f"{load.get('balance', 0):.3f}; total since start-up per expert "
              f"{load_obs.totals.sum(0).tolist()}")
        await dense.aclose()
        await moe.aclose()

    asyncio.run(measure())
    return 0
