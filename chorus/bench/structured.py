"""`chorus bench structured`: what constrained decoding costs, printed as tables.

1. The grammar libraries on each model's vocabulary: llguidance (chorus's choice) and, if installed,
   xgrammar: set-up (the tokenizer's view + compiling the schema) and the per-token cost of computing the
   mask and applying it to a logits row, walking the tokens of one valid answer (median over tokens).
2. How often a real model completes a valid answer: a fixed corpus of schemas (records, nested objects, lists,
   enums, nullable and alternative fields, free strings and numbers) at temperature 0 and 0.7; each answer is
   complete and valid (jsonschema), cut by ``max_tokens``, or invalid (never, by construction).
3. Decode tokens/s of chorus's engine with a JSON-schema constraint vs without, 1 stream and
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


CORPUS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "country", "population"],
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "year": {"type": "integer", "minimum": 1800, "maximum": 2030},
            "genres": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        },
        "required": ["title", "year", "genres"],
    },
    {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["sentiment", "confidence"],
    },
    {
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                    "required": ["sku", "qty"],
                },
            },
        },
        "required": ["order_id", "items"],
    },
    {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "address": {
                "type": "object",
                "properties": {"street": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["street", "zip"],
            },
            "email": {"type": ["string", "null"]},
        },
        "required": ["name", "address", "email"],
    },
    {
        "type": "object",
        "properties": {"answer": {"type": "boolean"}, "reason": {"type": "string"}},
        "required": ["answer", "reason"],
    },
    {
        "type": "object",
        "properties": {"temperatures": {"type": "array", "items": {"type": "number"}, "minItems": 3, "maxItems": 7}},
        "required": ["temperatures"],
    },
    {
        "type": "object",
        "properties": {"result": {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "unit": {"enum": ["m", "km"]}},
        "required": ["result", "unit"],
    },
    {
        "type": "object",
        "properties": {
            "steps": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            "final": {"type": "number"},
        },
        "required": ["steps", "final"],
    },
]
CORPUS_PROMPT = "Make up a plausible example and answer with JSON only, matching this JSON schema:\n{schema}"


def _corpus(spec: Any, max_tokens: int) -> list[str]:
    import jsonschema

    from chorus.engines.core.base import Constraint, SamplingParams
    from chorus.engines.core.generation import encode_prompt
    from chorus.engines.transformers.engine import TransformersEngine

    async def main() -> list[str]:
        engine = TransformersEngine.load(spec)
        await engine.start()
        out = []
        for temperature in (0.0, 0.7):
            valid = cut = invalid = tokens = 0
            for i, schema in enumerate(CORPUS):
                params = SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens,
                                        constraint=Constraint.json_schema(schema))
                ask = CORPUS_PROMPT.format(schema=json.dumps(schema))  # the schema in the prompt, as users write it
                req = encode_prompt(engine, params, messages=[{"role": "user", "content": ask}])
                c = (await engine.generate(req)).choices[0]
                tokens += len(c.token_ids)
                if c.finish_reason == "length":
                    cut += 1
                    continue
                try:
                    jsonschema.validate(json.loads(c.text), schema)
                    valid += 1
                except (ValueError, jsonschema.ValidationError):
                    invalid += 1
            out.append(f"| {spec.name} | {temperature} | {len(CORPUS)} | {valid} | {cut} | {invalid} | "
                       f"{tokens / len(CORPUS):.0f} |")
        await engine.aclose()
        return out

    return asyncio.run(main())


def _throughput(spec: Any, tokens: int, concurrency: int, rounds: int) -> list[str]:
    from chorus.engines.core.base import Constraint, SamplingParams
    from chorus.engines.core.generation import encode_prompt
    from chorus.engines.transformers.engine import TransformersEngine

    async def main() -> list[str]:
        engine = TransformersEngine.load(spec)
        await engine.start()
        free = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        constrained = SamplingParams(temperature=0, max_tokens=tokens, constraint=Constraint.json_schema(SCHEMA))

        async def run(params: SamplingParams, k: int) -> tuple[float, int]:
            # a raw prompt: no chat template, so no template stop string ends the free run early (Gemma's
            # fallback template stops at "\nUser:")
            req = encode_prompt(engine, params, text=PROMPT + "\n")
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
    p.add_argument("--max-tokens", type=int, default=256, help="per answer of the schema corpus")
    p.add_argument("--parts", default="masks,corpus,throughput", help="which tables, comma-separated")


def main(args: argparse.Namespace) -> int:
    import torch

    from chorus.config import load_config
    from chorus.engines.core.registry import prepare_model

    torch.set_num_threads(args.threads)
    config = load_config(args.config)
    specs = [config.model(m) for m in args.models.split(",")]
    paths = [prepare_model(s, log=lambda m: None) for s in specs]
    print(f"chorus bench structured: {', '.join(s.name for s in specs)}; {args.threads} threads; schema with "
          f"strings, an integer and a list; {args.tokens} tokens per stream, best of {args.rounds} rounds", flush=True)
    parts = set(args.parts.split(","))
    if "masks" in parts:
        _print_masks(specs, paths)
    if "corpus" in parts:
        _print_corpus(specs, args.max_tokens)
    if "throughput" in parts:
        _print_throughput(specs, args)
    return 0


def _print_masks(specs: list[Any], paths: list[Any]) -> None:
    from transformers import AutoTokenizer

    print("\n| model | vocabulary | library | set-up (s) | mask per token, median (ms) | first mask (ms) |")
    print("|---|---:|---|---:|---:|---:|")
    for spec, path in zip(specs, paths):
        for row in _mask_costs(AutoTokenizer.from_pretrained(str(path)), spec.name):
            print(row, flush=True)


def _print_corpus(specs: list[Any], max_tokens: int) -> None:
    print(f"\n| model | temperature | schemas | complete and valid | cut by max_tokens ({max_tokens}) | "
          "invalid | tokens per answer |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for spec in specs:
        for row in _corpus(spec, max_tokens):
            print(row, flush=True)


def _print_throughput(specs: list[Any], args: argparse.Namespace) -> None:
    print(
        "\n| model | streams | free tokens/s | constrained tokens/s | ratio | overhead | tokens (free / constrained) |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for spec in specs:
        for row in _throughput(spec, args.tokens, args.concurrency, args.rounds):
            print(row, flush=True)
