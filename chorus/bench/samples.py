"""`chorus bench samples`: what k samples of one prompt cost against one, on one engine.

The answer-side strategies draw k samples of a prompt per member in one request (``n`` = k). On the llama.cpp
engine the prompt is prefilled once and its KV cells are copied into the other k - 1 sequences, which then
decode together in one batch; on the transformers engine one prefill row is copied into k batch rows. This bench
loads one model in-process and times, round by round, a request for one sample and one for k (``--k``), both
``--tokens`` tokens long (``ignore_eos``), temperature 0.7, seeded, on a GSM8K-length prompt; it prints the wall
time of each and their ratio (best, median, and the per-round ratios' geometric mean with a 95% t interval).
The goal the answer-side issue set: k = 8 at most 3x one sample.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import numpy as np

PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
          "clips did Natalia sell altogether in April and May?\n\nSolve the problem step by step, and end with "
          '"The answer is N", where N is a number.')


async def run(args: argparse.Namespace) -> str:
    from chorus.bench.llama import paired_ratio
    from chorus.config import load_config
    from chorus.engines.core.base import GenerationRequest, SamplingParams
    from chorus.engines.core.generation import encode_prompt
    from chorus.engines.core.registry import build_engine

    spec = load_config(args.config).model(args.model)
    if spec.max_batch_size < args.k:
        spec = spec.model_copy(update={"max_batch_size": args.k})
    engine = build_engine(spec)
    await engine.start()
    try:
        base = SamplingParams(temperature=0.7, top_p=1.0, max_tokens=args.tokens, ignore_eos=True)
        req = encode_prompt(engine, base, messages=[{"role": "user", "content": PROMPT}])
        times: dict[int, list[float]] = {1: [], args.k: []}
        for r in range(args.rounds + 1):  # round 0 warms up
            for n in (1, args.k) if r % 2 else (args.k, 1):
                t0 = time.perf_counter()
                gen = await engine.generate(GenerationRequest(req.prompt_ids, SamplingParams(
                    temperature=0.7, top_p=1.0, max_tokens=args.tokens, ignore_eos=True, n=n, seed=r)))
                assert len(gen.choices) == n
                if r:
                    times[n].append(time.perf_counter() - t0)
    finally:
        await engine.aclose()
    one, many = times[1], times[args.k]
    ratios = np.array(many) / np.array(one)
    return "\n".join([
        f"chorus bench samples: {spec.name} ({spec.engine}), prompt {len(req.prompt_ids)} tokens, {args.tokens} "
        f"tokens per sample, {args.rounds} rounds", "",
        "| request | seconds best | median | k / one: best | median | paired rounds: geometric mean [95% CI] |",
        "|---|---:|---:|---:|---:|---:|",
        f"| 1 sample | {min(one):.2f} | {statistics.median(one):.2f} | | | |",
        f"| {args.k} samples (n={args.k}) | {min(many):.2f} | {statistics.median(many):.2f} | "
        f"{min(many) / min(one):.2f}x | {float(np.median(ratios)):.2f}x | {paired_ratio(many, one)} |"])


def main(args: argparse.Namespace) -> int:
    print(asyncio.run(run(args)))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct-llama", help="a served model of the config")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
