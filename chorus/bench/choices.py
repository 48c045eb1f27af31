"""`chorus bench choices`: multiple-choice scoring with a shared prefix vs a whole forward per choice.

On HellaSwag-style items (a context and its endings), in one run, same model and threads, rounds
interleaved and each figure the best of ``--rounds``:

* ``shared prefix``: what ``/v1/choices`` does, the context prefilled once and every ending scored
  from its cache in one batched forward (``engine.score_continuations``);
* ``forward per choice``: ``context + ending`` scored whole, one forward per ending (what a client of
  ``/v1/completions`` with ``echo`` and ``logprobs`` costs the server).

It prints choices/s for both, the ratio, and the largest difference of any ending's summed logprob
between the two (they must agree to about 1e-4).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from pathlib import Path

from chorus.clients.local import markdown_table
from chorus.config import load_config
from chorus.engines.core.registry import build_engine
from chorus.engines.core.scoring import Split, by_prompt_logprobs, split_text


def load_items(path: Path, limit: int) -> list[tuple[str, list[str]]]:
    items = []
    with path.open() as f:
        for line in f:
            row = json.loads(line)
            items.append((row["context"] + " ", list(row["choices"])))
            if len(items) >= limit:
                break
    return items


async def bench(args: argparse.Namespace) -> str:
    config = load_config(args.config)
    spec = config.model(args.model)
    engine = build_engine(spec, {m.name: m for m in config.models})
    await engine.start()
    try:
        splits: list[Split] = [split_text(engine.tokenizer, p, c) for p, c in load_items(Path(args.data), args.items)]
        choices = sum(len(s.choices) for s in splits)
        ways = {"shared prefix": engine.score_continuations,
                "forward per choice": lambda prefix, conts: by_prompt_logprobs(engine, prefix, conts)}
        best = dict.fromkeys(ways, math.inf)
        scores: dict[str, list[float]] = {}
        await engine.score_continuations(splits[0].prefix, splits[0].choices)  # warm-up
        for _ in range(args.rounds):
            for name, way in ways.items():
                t0 = time.perf_counter()
                out = [await way(s.prefix, s.choices) for s in splits]
                best[name] = min(best[name], time.perf_counter() - t0)
                scores[name] = [math.fsum(t) for per_item in out for t in per_item]
    finally:
        await engine.aclose()
    diff = max(abs(a - b) for a, b in zip(scores["shared prefix"], scores["forward per choice"]))
    base = best["forward per choice"]
    rows = [[name, f"{choices / t:.1f}", f"{base / t:.2f}x"] for name, t in best.items()]
    tokens = sum(len(s.prefix) + sum(map(len, s.choices)) for s in splits) / len(splits)
    return (f"{args.model}: {len(splits)} items ({choices} choices, {tokens:.0f} tokens per item), best of "
            f"{args.rounds} rounds; largest |difference| of a choice's logprob: {diff:.1e}\n"
            + markdown_table(["scoring", "choices/s", "vs forward per choice"], rows))


def main(args: argparse.Namespace) -> int:
    print(asyncio.run(bench(args)))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="HellaSwag-style JSONL (context, choices)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--items", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
