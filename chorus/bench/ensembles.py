"""`chorus bench ensembles`: what ensembling costs, as tables (ratios against baselines in the same run).

1. logit_average of two SmolLM2 members (greedy, ``--tokens`` new tokens, EOS ignored):
   - vs the rate implied by the members' own step times: each member alone, one session, stepped
     token by token; implied tokens/s = 1 / (step_a + step_b). Goal: >= 0.9x. Measured with both
     members in one engine (their steps batch into one forward) and in two engine instances.
   - vs recomputing without KV caches: each step, a full forward pass of both members over the whole
     sequence, probabilities averaged. Goal: >= 10x at 256 new tokens.
2. crowd_vote scoring: ``--candidates`` candidates x ``--words`` words, all ordered pairs, word and
   character ROUGE-L: chorus (rapidfuzz C++ LCS) vs the `rouge-score` package (its tokenizer and LCS;
   characters through the same LCS routine, timed on a few pairs and extrapolated: all pairs take
   many minutes in pure Python), with the largest difference between the two.
3. exchange_of_thought and mixture_of_agents on the default models: wall time of the strategy (members
   of a round run concurrently and batch) vs the same member requests replayed one after another.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

from chorus.clients.local import markdown_table

PROMPT = [
    {
        "role": "user",
        "content": "Natalia sold clips to 48 of her friends in April, and then she sold half as "
        "many clips in May. How many clips did Natalia sell altogether in April and May?",
    }
]


def table(title: str, header: list[str], rows: list[list[str]]) -> str:
    return f"\n{title}\n{markdown_table(header, rows)}"


# ---- 1. logit averaging ----

async def _member_step_time(engine: Any, ids: list[int], tokens: int) -> float:
    session = engine.open_session()
    try:
        logits = await session.prefill(ids)
        t0 = time.perf_counter()
        for _ in range(tokens):
            logits = await session.step(int(logits.argmax()))
        return (time.perf_counter() - t0) / tokens
    finally:
        session.close()


async def _ensemble_rate(ens: Any, ids: list[int], tokens: int) -> float:
    from chorus.engines.core.base import GenerationRequest, SamplingParams

    req = GenerationRequest(ids, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    t0 = time.perf_counter()
    gen = await ens.generate(req)
    return gen.completion_tokens / (time.perf_counter() - t0)


def _no_cache_rate(models: list[Any], ids: list[int], tokens: int) -> float:
    import torch

    seq = torch.tensor([ids])
    t0 = time.perf_counter()
    with torch.inference_mode():
        for _ in range(tokens):
            p = torch.stack([torch.softmax(m(input_ids=seq, use_cache=False).logits[0, -1].float(), -1)
                             for m in models]).sum(0)
            seq = torch.cat([seq, p.argmax().view(1, 1)], dim=1)
    return tokens / (time.perf_counter() - t0)


async def bench_logit_average(engine: Any, twin: Any, tokens: int, rounds: int, no_cache_tokens: int) -> str:
    from chorus.ensembles.logit_average.shared_vocab import LogitAverage

    ids = engine.tokenizer.encode_chat(PROMPT)
    shared, separate = LogitAverage([engine, engine]), LogitAverage([engine, twin])
    steps, rates, rates_sep = [], [], []
    for _ in range(rounds):  # interleaved: the machine's noise hits all alike
        a = await _member_step_time(engine, ids, tokens)
        b = await _member_step_time(twin, ids, tokens)
        steps.append(a + b)
        rates.append(await _ensemble_rate(shared, ids, tokens))
        rates_sep.append(await _ensemble_rate(separate, ids, tokens))
    implied = 1 / min(steps)
    best, best_sep = max(rates), max(rates_sep)
    no_cache = _no_cache_rate([engine.model, engine.model], ids, no_cache_tokens)  # the engine is idle now
    rows = [
        ["members' own steps, implied (1 / (step_a + step_b))", f"{implied:.1f}", "1.00x"],
        ["logit_average, members in one engine (their steps share a forward)", f"{best:.1f}",
         f"{best / implied:.2f}x"],
        ["logit_average, members in two engine instances", f"{best_sep:.1f}", f"{best_sep / implied:.2f}x"],
        [f"recompute without KV caches ({no_cache_tokens} tokens)", f"{no_cache:.2f}", f"{no_cache / implied:.3f}x"],
    ]
    out = table(f"logit_average of 2 x {engine.name}, prompt {len(ids)} tokens, {tokens} new tokens, greedy, "
                f"best of {rounds}", ["", "tokens/s", "vs implied"], rows)
    return out + (f"\nKV-cached ensemble vs recompute: {best / no_cache:.1f}x (one engine), "
                  f"{best_sep / no_cache:.1f}x (two instances)")


# ---- 2. crowd_vote scoring ----

def bench_rouge(candidates: int, words: int, char_pairs: int, seed: int = 0) -> str:
    from rouge_score import rouge_scorer

    from chorus.ensembles.similarity import char_rouge_l, word_rouge_l

    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(300)] + ["the", "a", "of", "and", "to", "in", "is", "it"]
    texts = [" ".join(rng.choice(vocab) for _ in range(words)) for _ in range(candidates)]
    pairs = [(i, j) for i in range(candidates) for j in range(candidates)]
    t0 = time.perf_counter()
    ours_w = word_rouge_l(texts)
    t_w = time.perf_counter() - t0
    t0 = time.perf_counter()
    ours_c = char_rouge_l(texts)
    t_c = time.perf_counter() - t0
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    t0 = time.perf_counter()
    ref_w = {(i, j): scorer.score(texts[j], texts[i])["rougeL"].fmeasure for i, j in pairs}
    ref_t_w = time.perf_counter() - t0
    sample = rng.sample(pairs, min(char_pairs, len(pairs)))  # pure-Python character LCS: minutes for all pairs
    t0 = time.perf_counter()
    ref_c = {
        (i, j): rouge_scorer._score_lcs(list(texts[j].lower()), list(texts[i].lower())).fmeasure for i, j in sample
    }
    ref_t_c = (time.perf_counter() - t0) / len(sample) * len(pairs)
    diff = max(max(abs(ours_w[p] - v) for p, v in ref_w.items()), max(abs(ours_c[p] - v) for p, v in ref_c.items()))
    rows = [["word ROUGE-L", f"{ref_t_w:.2f}", f"{t_w:.4f}", f"{ref_t_w / t_w:.0f}x"],
            [f"char ROUGE-L (package extrapolated from {len(sample)} pairs)", f"{ref_t_c:.1f}", f"{t_c:.4f}",
             f"{ref_t_c / t_c:.0f}x"],
            ["both", f"{ref_t_w + ref_t_c:.1f}", f"{t_w + t_c:.4f}", f"{(ref_t_w + ref_t_c) / (t_w + t_c):.0f}x"]]
    return table(f"crowd_vote scoring: {candidates} candidates x {words} words, all {len(pairs)} ordered pairs",
                 ["", "rouge-score package s", "chorus (rapidfuzz) s", "speed-up"], rows) + \
        f"\nlargest difference from the package: {diff:.1e}"


# ---- 3. text-level strategies: concurrency ----

async def bench_text_strategies(engines: dict[str, Any], max_tokens: int) -> str:
    from chorus.engines.core.base import SamplingParams
    from chorus.ensembles.base import Ensemble
    from chorus.ensembles.call import Prompt
    from chorus.ensembles.spec import EnsembleSpec

    specs = {
        "exchange_of_thought (3 members, memory, max_rounds 2)": {
            "strategy": "exchange_of_thought", "max_rounds": 2,
            "members": ["smollm2-135m-instruct", {"model": "smollm2-135m-instruct", "system": "Be brief."},
                        "gemma-3-270m"]},
        "mixture_of_agents (3 proposers, 1 layer)": {
            "strategy": "mixture_of_agents", "aggregator": "smollm2-135m-instruct",
            "members": ["smollm2-135m-instruct", {"model": "smollm2-135m-instruct", "system": "Be brief."},
                        "gemma-3-270m"]},
    }
    rows = []
    for title, spec in specs.items():
        ens = Ensemble.build(EnsembleSpec.model_validate(spec), engines)
        call = ens.call(Prompt(messages=PROMPT), lambda d: SamplingParams(temperature=0, max_tokens=max_tokens))
        t0 = time.perf_counter()
        await ens.run(call)
        wall = time.perf_counter() - t0
        t0 = time.perf_counter()
        for member, req in call.requests:  # the same requests, one after another
            await member.engine.generate(req)
        sequential = time.perf_counter() - t0
        rows.append([title, str(len(call.requests)), f"{sequential:.1f}", f"{wall:.1f}", f"{sequential / wall:.2f}x"])
    return table(f"text-level strategies on the default models (greedy, max_tokens {max_tokens})",
                 ["strategy", "member calls", "sequential s", "strategy wall s", "concurrency gain"], rows)


async def _run(args: argparse.Namespace) -> None:
    import torch

    from chorus.config import load_config
    from chorus.engines.transformers.engine import TransformersEngine

    torch.set_num_threads(args.threads)
    print(bench_rouge(args.candidates, args.words, args.char_pairs), flush=True)
    config = load_config(args.config)
    engines = {}
    for spec in config.models:
        engines[spec.name] = TransformersEngine.load(spec)
        await engines[spec.name].start()
    twin = TransformersEngine.load(config.model("smollm2-135m-instruct"))  # a second instance: its own batch
    await twin.start()
    try:
        print(await bench_logit_average(engines["smollm2-135m-instruct"], twin, args.tokens, args.rounds,
                                        args.no_cache_tokens), flush=True)
        print(await bench_text_strategies(engines, args.max_tokens), flush=True)
    finally:
        for e in [*engines.values(), twin]:
            await e.aclose()


def main(args: argparse.Namespace) -> int:
    asyncio.run(_run(args))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=256, help="new tokens for logit averaging")
    p.add_argument("--no-cache-tokens", type=int, default=256, help="new tokens for the no-KV-cache baseline")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--candidates", type=int, default=16)
    p.add_argument("--words", type=int, default=400)
    p.add_argument("--char-pairs", type=int, default=6, help="pairs the slow pure-Python character LCS is timed on")
    p.add_argument("--max-tokens", type=int, default=96, help="per member call in the text-level strategies")
    p.add_argument("--threads", type=int, default=2)

