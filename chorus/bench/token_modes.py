"""`chorus bench modes`: what token ensembles cost in each mode, as one table (ratios within the run).

For each pair of members (greedy, up to ``--tokens`` new tokens per prompt, natural end of sequence,
the same ``--prompts`` chat prompts for every system, each engine warmed up first, each figure the best of
``--rounds`` interleaved runs): each member alone, ``full`` averaging,
``selective`` at each ``--gates`` value (top-1 gate) and ``speculative`` with ``--k`` drafts. Columns:
tokens/s, the ratio to full averaging, to the lead alone and to the slowest member alone (the largest:
what the issue's goal says an ensemble should cost), the share of positions where the members
were combined, the speculative acceptance (drafts the output matched) and tokens per round, and
whether the output equals full averaging's token for token (speculative must; selective need not).

Pairs: SmolLM2 with its MoE and MoDr derivatives (one vocabulary; they answer much like SmolLM2: the
best case for drafts), SmolLM2 with itself under two system prompts (a prompt ensemble: members that
disagree), the Qwen2.5-Coder pair when prepared (0.5B drafts, 1.5B verifies), and SmolLM2 + Gemma
(different vocabularies: ``topk_union``, full mode only).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass
from typing import Any

from chorus.clients.local import markdown_table

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
    "clips did Natalia sell altogether in April and May?",
    "Why is the sky blue? Explain it to a child.",
    "Write a short story about a robot who learns to paint.",
    "List five uses of a paper clip.",
]
PERSONAS = ("You are a careful teacher. Explain step by step.", "You are a pirate. Answer like one.")


@dataclass
class Pair:
    title: str
    members: list[str]
    personas: tuple[str, ...] | None = None
    lead_for_speculative: int = 0  # the member that drafts (the cheaper one)
    lead_for_selective: int = 0  # the member that decodes (the stronger one, where they differ)
    topk_union: bool = False


PAIRS = [
    Pair("SmolLM2 + SmolLM2-MoE (4 experts, top-2)", ["smollm2-135m-instruct", "smollm2-moe"]),
    Pair("SmolLM2 + SmolLM2-MoDr", ["smollm2-135m-instruct", "smollm2-modr"]),
    Pair("SmolLM2 x 2 system prompts (prompt ensemble)", ["smollm2-135m-instruct", "smollm2-135m-instruct"],
         personas=PERSONAS),
    Pair("Qwen2.5-Coder 0.5B + 1.5B", ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"],
         lead_for_speculative=0, lead_for_selective=1),
    Pair("SmolLM2 + Gemma-3 (topk_union)", ["smollm2-135m-instruct", "gemma-3-270m"], topk_union=True),
]


def prompts_for(engines: list[Any], pair: Pair, question: str) -> list[list[int]]:
    out = []
    for i, e in enumerate(engines):
        msgs = [{"role": "user", "content": question}]
        if pair.personas:
            msgs = [{"role": "system", "content": pair.personas[i]}, *msgs]
        out.append(e.tokenizer.encode_chat(msgs))
    return out


@dataclass
class Tally:
    """A system's mode figures over every prompt."""

    positions: int = 0
    consulted: int = 0
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0

    def add(self, stats: Any) -> None:
        for name in ("positions", "consulted", "proposed", "accepted", "rounds"):
            setattr(self, name, getattr(self, name) + getattr(stats, name))


@dataclass
class Result:
    label: str
    rate: float
    outputs: list[list[int]]
    tally: Tally | None = None


async def run_system(pair: Pair, members: list[Any], per_prompt: list[list[list[int]]], params: Any,
                     mode: str, who: int, gate: float, k: int) -> tuple[float, list[list[int]], Tally | None]:
    """tokens/s, each prompt's output, the mode's figures: ``mode`` is ``alone`` (member ``who``), ``union``
    (topk_union) or a logit_average mode led by ``who``; the prompts one after another."""
    from chorus.engines.core.base import GenerationRequest
    from chorus.ensembles.logit_average.mixing import Mixing
    from chorus.ensembles.logit_average.shared_vocab import LogitAverage
    from chorus.ensembles.logit_average.topk_union import TopkUnion

    outputs, tokens, tally = [], 0, None
    t0 = time.perf_counter()
    for prompts in per_prompt:
        if mode == "union":
            reqs = [GenerationRequest(p, params, extra_stop=m.tokenizer.chat_stop) for p, m in zip(prompts, members)]
            ids: list[int] = []
            async for d in TopkUnion(members, None, 10).stream_requests(reqs):
                ids += d.token_ids
        elif mode == "alone":
            ids = (await members[who].generate(GenerationRequest(prompts[who], params))).choices[0].token_ids
        else:  # one engine per prompt: with personas the members' prompts differ per question
            engine = LogitAverage(members, Mixing(mode=mode, lead=who, gate=gate, k=k), prompts=prompts if pair.personas else None)
            ids = (await engine.generate(GenerationRequest(prompts[who], params))).choices[0].token_ids
            tally = tally or Tally()
            tally.add(engine.tally)
        outputs.append(ids)
        tokens += len(ids)
    return tokens / (time.perf_counter() - t0), outputs, tally


async def bench_pair(pair: Pair, engines: dict[str, Any], args: argparse.Namespace) -> list[list[str]]:
    from chorus.engines.core.base import GenerationRequest, SamplingParams

    members = [engines[m] for m in pair.members]
    params = SamplingParams(temperature=0, max_tokens=args.tokens)
    per_prompt = [prompts_for(members, pair, q) for q in PROMPTS[: args.prompts]]
    plan: list[tuple[str, str, int, float]] = []  # label, mode, lead, gate
    distinct = [0] if pair.personas else list(range(len(members)))  # a prompt ensemble has one model
    plan += [(f"{pair.members[who]} alone", "alone", who, 0.0) for who in distinct]
    if pair.topk_union:
        plan.append(("full (topk_union)", "union", 0, 0.0))
    else:
        plan.append(("full", "full", 0, 0.0))
        plan += [(f"selective, gate {g:g}, lead {pair.members[pair.lead_for_selective]}", "selective",
                  pair.lead_for_selective, g) for g in args.gates]
        plan.append((f"speculative, k={args.k}, lead {pair.members[pair.lead_for_speculative]}", "speculative",
                     pair.lead_for_speculative, 0.0))
    for m in members:  # warm-up: first forwards (lazy initialisation) are not timed
        await m.generate(GenerationRequest(per_prompt[0][0], SamplingParams(temperature=0, max_tokens=4)))
    results: list[Result] = []
    for round_ in range(args.rounds):  # rounds interleave the systems: drift in machine load hits all alike
        for j, (label, mode, who, gate) in enumerate(plan):
            rate, outputs, tally = await run_system(pair, members, per_prompt, params, mode, who, gate, args.k)
            if round_ == 0:
                results.append(Result(label, rate, outputs, tally))
            else:
                results[j].rate = max(results[j].rate, rate)
    full = next(r for r in results if r.label.startswith("full"))
    alone = {who: r for (_, mode, who, _), r in zip(plan, results) if mode == "alone"}
    slowest = min(alone.values(), key=lambda r: r.rate)  # the largest member: what an ensemble should cost
    rows = []
    for (_, _mode, who, _), r in zip(plan, results):
        lead = alone.get(who, next(iter(alone.values())))
        share = accept = per_round = "-"
        if r.tally is not None:
            share = f"{100 * r.tally.consulted / max(r.tally.positions, 1):.0f}%"
            if r.tally.rounds:
                accept = f"{100 * r.tally.accepted / max(r.tally.proposed, 1):.0f}%"
                per_round = f"{r.tally.positions / r.tally.rounds:.2f}"
        same = "yes" if r.outputs == full.outputs else "no"
        rows.append([pair.title, r.label, f"{r.rate:.1f}", f"{r.rate / full.rate:.2f}x", f"{r.rate / lead.rate:.2f}x",
                     f"{r.rate / slowest.rate:.2f}x", share, accept, per_round, "-" if r is full else same])
    return rows


async def _run(args: argparse.Namespace) -> str:
    import torch

    from chorus.config import load_config
    from chorus.engines.core.registry import build_engine, is_ready

    torch.set_num_threads(args.threads)
    config = load_config(args.config)
    specs = {m.name: m for m in config.models}
    chosen = [p for p in PAIRS if not args.pairs or any(w.lower() in p.title.lower() for w in args.pairs)]
    wanted = [p for p in chosen if all(m in specs and is_ready(specs[m]) for m in p.members)]
    skipped = [p.title for p in chosen if p not in wanted]
    engines: dict[str, Any] = {}
    try:
        for name in dict.fromkeys(m for p in wanted for m in p.members):
            engines[name] = build_engine(specs[name], specs)
            await engines[name].start()
        rows = []
        for pair in wanted:
            print(f"{pair.title} ...", flush=True)
            rows += await bench_pair(pair, engines, args)
    finally:
        for e in engines.values():
            await e.aclose()
    note = f"\nnot prepared, left out: {', '.join(skipped)}" if skipped else ""
    return (f"\ntoken ensembles by mode: {args.prompts} chat prompts, greedy, up to {args.tokens} new tokens each, "
            f"{args.threads} threads, best of {args.rounds} interleaved rounds\n" + markdown_table(
                ["pair", "system", "tokens/s", "vs full", "vs lead alone", "vs slowest member alone", "combined at",
                 "drafts accepted",
                 "tokens/round", "= full's output"], rows) + note)


def main(args: argparse.Namespace) -> int:
    print(asyncio.run(_run(args)))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=64, help="new tokens per prompt at most")
    p.add_argument("--prompts", type=int, default=3, help=f"how many of the {len(PROMPTS)} built-in prompts")
    p.add_argument("--gates", type=float, nargs="+", default=[0.2, 0.5], help="selective: top-1 gates to run")
    p.add_argument("--rounds", type=int, default=2, help="each system's best of this many interleaved runs")
    p.add_argument("--k", type=int, default=4, help="speculative: drafts per round")
    p.add_argument("--pairs", nargs="+", help="only the pairs whose title contains one of these words")
    p.add_argument("--threads", type=int, default=2)
