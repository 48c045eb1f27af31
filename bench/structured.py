"""`chorus bench structured`: what constrained decoding costs, printed as tables.

1. The grammar libraries on each model's vocabulary: llguidance (chorus's choice) and, if installed,
   xgrammar: set-up (the tokenizer's view + compiling the schema) and the per-token cost of computing the
   mask and applying it to a logits row, walking the tokens of one valid answer (median over tokens).
2. Decode tokens/s of chorus's engine with a JSON-schema constraint vs without, 1 stream and
   ``--concurrency`` streams, same prompt, greedy, ``--tokens`` tokens per stream (the schema admits an
   answer that long, so both runs decode the same number of tokens); rounds interleaved, best round kept.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string"}, "population": {"type": "integer"},
    "districts": {"type": "array", "items": {"type": "string"}, "minItems": 60}},
    "required": ["city", "population", "districts"], "additionalProperties": False}
ANSWER = json.dumps({"city": "Paris", "population": 2102650,
                     "districts": ["Louvre", "Bourse", "Temple", "Hotel-de-Ville", "Pantheon", "Luxembourg"] * 10})
PROMPT = "Describe Paris as JSON: its name, population and a long list of districts."


def _mask_costs(hf: Any, name: str) -> list[str]:
    import torch

    rows = []
    ids = hf.encode(ANSWER, add_special_tokens=False)
    vocab = len(hf)
    logits = torch.randn(vocab)
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch as lt

        t0 = time.perf_counter()
        lltok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
        matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
        setup = time.perf_counter() - t0
        mask = lt.allocate_token_bitmask(1, lltok.vocab_size)
        per = []
        for t in ids:
            t1 = time.perf_counter()
            lt.fill_next_token_bitmask(matcher, mask, 0)
            row = logits.clone()
            lt.apply_token_bitmask_inplace(row, mask)
            per.append(time.perf_counter() - t1)
            assert matcher.consume_token(t), matcher.get_error()
        rows.append(f"| {name} | {vocab} | llguidance | {setup:.2f} | {1e3 * statistics.median(per):.3f} | "
                    f"{1e3 * per[0]:.1f} |")
    except ImportError:  # pragma: no cover - a dependency of chorus
        rows.append(f"| {name} | {vocab} | llguidance | not installed | | |")
    try:
        import xgrammar as xgr
    except ImportError:
        rows.append(f"| {name} | {vocab} | xgrammar | not installed (pip install xgrammar) | | |")
        return rows
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    matcher_x = xgr.GrammarMatcher(compiled)
    setup = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    per = []
    for t in ids:
        t1 = time.perf_counter()
        matcher_x.fill_next_token_bitmask(bitmask)
        row = logits.clone()
        xgr.apply_token_bitmask_inplace(row, bitmask[0])
        per.append(time.perf_counter() - t1)
        assert matcher_x.accept_token(t)
    rows.append(f"| {name} | {vocab} | xgrammar | {setup:.2f} | {1e3 * statistics.median(per):.3f} | "
                f"{1e3 * per[0]:.1f} |")
    return rows


def _throughput(spec: Any, tokens: int, concurrency: int, rounds: int) -> list[str]:
    from chorus.engines.base import Constraint, SamplingParams
    from chorus.engines.generation import encode_prompt
    from chorus.engines.transformers_engine import TransformersEngine

    async def main() -> list[str]:
        engine = TransformersEngine.load(spec)
        await engine.start()
        msgs = [{"role": "user", "content": PROMPT}]
        free = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        constrained = SamplingParams(temperature=0, max_tokens=tokens, constraint=Constraint.json_schema(SCHEMA))

        async def run(params: SamplingParams, k: int) -> tuple[float, int]:
            req = encode_prompt(engine, params, messages=msgs)
            t0 = time.perf_counter()
            gens = await asyncio.gather(*(engine.generate(req) for _ in range(k)))
            n = sum(g.completion_tokens for g in gens)
            return n / (time.perf_counter() - t0), n

        await run(constrained, 1)  # warm-up: llguidance's view of the vocabulary is built once
        best: dict[tuple[str, int], tuple[float, int]] = {}
        for _ in range(rounds):
            for k in (1, concurrency):
                for label, params in (("free", free), ("json schema", constrained)):
                    got = await run(params, k)
                    if got[0] > best.get((label, k), (0.0, 0))[0]:
                        best[(label, k)] = got
        await engine.aclose()
        out = []
        for k in (1, concurrency):
            f, c = best[("free", k)], best[("json schema", k)]
            out.append(f"| {spec.name} | {k} | {f[0]:.1f} | {c[0]:.1f} | {c[0] / f[0]:.3f} | "
                       f"{100 * (1 - c[0] / f[0]):+.1f}% | {f[1]} / {c[1]} |")
        return out

    return asyncio.run(main())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="smollm2-135m-instruct,gemma-3-270m")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)


def main(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from chorus.config import load_config
    from chorus.engines.prepare import prepare_model

    torch.set_num_threads(args.threads)
    config = load_config(args.config)
    specs = [config.model(m) for m in args.models.split(",")]
    paths = [prepare_model(s, log=lambda m: None) for s in specs]
    print(f"chorus bench structured: {', '.join(s.name for s in specs)}; {args.threads} threads; schema with "
          f"strings, an integer and a list; {args.tokens} tokens per stream, best of {args.rounds} rounds", flush=True)
    print("\n| model | vocabulary | library | set-up (s) | mask per token, median (ms) | first mask (ms) |")
    print("|---|---:|---|---:|---:|---:|")
    for spec, path in zip(specs, paths):
        for row in _mask_costs(AutoTokenizer.from_pretrained(str(path)), spec.name):
            print(row, flush=True)
    print("\n| model | streams | free tokens/s | constrained tokens/s | ratio | overhead | tokens (free / constrained) |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for spec in specs:
        for row in _throughput(spec, args.tokens, args.concurrency, args.rounds):
            print(row, flush=True)
    return 0
