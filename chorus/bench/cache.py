"""`chorus bench cache`: prompt caching, cache on against off, in one run, on either engine.

One ``chorus serve`` with two entries of one model: ``cached`` (the engine's prefix cache as by default:
``prefix_cache_slots: 4`` on llama.cpp, ``prefix_cache_mib: 256`` on transformers) and ``uncached`` (0); requests
alternate between them, each started on an idle machine. ``--engine llama_cpp`` loads the model's GGUF,
``--engine transformers`` its prepared checkpoint (``chorus models prepare``). Greedy, streamed; time to first
token (TTFT) is measured at the client.

- (a) one long system prompt (``--system-tokens``, about 1,500) and ``--questions`` different short questions:
  the first request of each entry is cold; then each question once on each entry. Rows: cold TTFT, warm TTFT
  (median), and per question the cached entry's TTFT over the uncached one's (paired: geometric mean, 95% t
  interval), with the tokens the cache served (usage's ``cached_tokens``).
- (b) a ``--turns``-turn chat that resends its history every turn (``--chat-tokens`` per answer): the whole
  conversation's seconds on each entry, ``--rounds`` times, and the ratio.
- (c) ``n = 8`` samples of one GSM8K-length question against one sample on the cached entry (the samples share
  one prefill by forking it, cache or not).
- (d) Exchange-of-Thought (two agents of the model, memory topology, up to 3 rounds) and mixture-of-agents (two
  proposers, the model as judge), one ensemble over each entry, on ``--ensemble-questions`` one-line questions
  (``--chat-tokens`` a call): seconds end to end, paired by question.

llama-server is not a peer here (said under the table).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from chorus.bench.engine import chat_chunks, settle
from chorus.bench.llama import paired_ratio
from chorus.clients.local import free_port, wait_ready

QUESTIONS = [
    "What is the capital of France?", "Name a prime number larger than 10.", "How many legs does a spider have?",
    "What colour is the sky on a clear day?", "Translate 'thank you' into Spanish.", "What is 12 times 12?",
    "Who wrote Romeo and Juliet?", "What is the boiling point of water in Celsius?", "Name a planet with rings.",
    "What is the opposite of 'ancient'?", "How many days are in a leap year?", "What gas do plants breathe in?",
    "What is the largest ocean?", "Spell 'necessary' backwards.", "What is the square root of 81?",
    "Which animal is known as the ship of the desert?"]
RULE = "Rule {i}: when a question touches topic {i}, answer in one short sentence, politely, and cite rule {i}."
GSM = ("Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her "
       "friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh duck "
       "egg. How much in dollars does she make every day at the farmers' market? Solve it step by step.")


async def _ask(client: httpx.AsyncClient, url: str, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> tuple[float, float, dict[str, Any]]:
    """(TTFT, total seconds, usage) of one streamed request."""
    t0 = time.perf_counter()
    ttft, usage = None, {}
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async for chunk in chat_chunks(client, url, streamed, headers):
        if chunk.get("usage"):
            usage = chunk["usage"]
        if ttft is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
            ttft = time.perf_counter() - t0
    return ttft or 0.0, time.perf_counter() - t0, usage


def ask(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[float, float, dict[str, Any]]:
    settle()

    async def main() -> tuple[float, float, dict[str, Any]]:
        async with httpx.AsyncClient(timeout=900) as client:
            return await _ask(client, url, body, headers)

    return asyncio.run(main())


def system_prompt(tokens: int) -> str:
    """About ``tokens`` tokens of rules (some 25 tokens a rule on SmolLM2's tokenizer)."""
    return " ".join(RULE.format(i=i) for i in range(max(1, tokens // 25)))


def main(args: argparse.Namespace) -> int:
    from chorus.config import load_config

    base = load_config(args.config).model(args.model)
    if args.engine == "llama_cpp":
        entry = {"engine": "llama_cpp", **({"source": base.sources} if base.source else {"path": base.path}),
                 **({"gguf": base.gguf.model_dump()} if base.gguf else {}), "max_batch_size": 8, "max_model_len": 2048}
        models = [{**entry, "name": "cached", "llama_cpp": {"threads": args.threads}},
                  {**entry, "name": "uncached", "llama_cpp": {"threads": args.threads, "prefix_cache_slots": 0}}]
    else:
        path = base.checkpoint_dir()
        if not (path / "config.json").is_file():
            print(f"chorus bench cache: {args.model} has no checkpoint at {path}; run: chorus models prepare "
                  f"{args.model}", file=sys.stderr)
            return 2
        entry = {"engine": "transformers", "path": str(path), "dtype": base.dtype, "max_batch_size": 8,
                 "max_model_len": 2048}
        models = [{**entry, "name": "cached"}, {**entry, "name": "uncached", "transformers": {"prefix_cache_mib": 0}}]
    config = {"models": models, "ensembles": [e for m in ("cached", "uncached") for e in ensembles(m)]}
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    system = system_prompt(args.system_tokens)
    rows: list[list[str]] = []
    with tempfile.TemporaryDirectory() as tmpdir:
        cfg = Path(tmpdir) / "cache.yaml"
        cfg.write_text(json.dumps(config))
        port = free_port()
        log = Path(tmpdir) / "serve.log"
        proc = subprocess.Popen([sys.executable, "-m", "chorus", "serve", "--config", str(cfg), "--port", str(port),
                                 "--no-prepare", "--log-level", "warning"], stdout=open(log, "w"),
                                stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url + "/v1/models", proc, timeout=600)
            print(f"chorus bench cache: {args.model} through engine: {args.engine}, {args.threads} threads, greedy",
                  flush=True)
            for w in args.workloads:
                rows += workload_a(url, system, args) if w == "a" else WORKLOADS[w](url, args)
        finally:
            proc.terminate()
            proc.wait(30)
    print()
    print("| workload | measure | cached | uncached | cached / uncached | n |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print("\nllama-server: not a peer in this bench")
    return 0


def workload_a(url: str, system: str, args: argparse.Namespace) -> list[list[str]]:
    def body(model: str, q: str) -> dict[str, Any]:
        return {"model": model, "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
                "max_tokens": 4, "temperature": 0}

    cold = {m: ask(url, body(m, "Hello.")) for m in ("cached", "uncached")}
    warm: dict[str, list[float]] = {"cached": [], "uncached": []}
    served: list[int] = []
    questions = (QUESTIONS * (args.questions // len(QUESTIONS) + 1))[:args.questions]
    for i, q in enumerate(questions):
        order = ("cached", "uncached") if i % 2 == 0 else ("uncached", "cached")
        for m in order:
            ttft, _, usage = ask(url, body(m, q))
            warm[m].append(ttft)
            if m == "cached":
                served.append(usage.get("prompt_tokens_details", {}).get("cached_tokens", 0))
    prompt = cold["cached"][2].get("prompt_tokens", 0)
    n = len(questions)
    c, u = statistics.median(warm["cached"]), statistics.median(warm["uncached"])
    return [
        [f"(a) system prompt of {prompt} tokens", "cold TTFT (s), first request", f"{cold['cached'][0]:.2f}",
         f"{cold['uncached'][0]:.2f}", "-", "1"],
        ["(a)", "warm TTFT (s), median over questions", f"{c:.3f}", f"{u:.3f}",
         paired_ratio(warm["cached"], warm["uncached"]), str(n)],
        ["(a)", "warm TTFT / cold TTFT", f"{c / cold['cached'][0]:.3f}x", f"{u / cold['uncached'][0]:.3f}x", "-",
         str(n)],
        ["(a)", "prompt tokens served from the cache, median", str(int(statistics.median(served))), "0", "-", str(n)],
    ]


def workload_b(url: str, args: argparse.Namespace) -> list[list[str]]:
    def conversation(model: str) -> float:
        history: list[dict[str, str]] = [{"role": "system", "content": "You are a helpful assistant."}]
        total = 0.0
        for turn in range(args.turns):
            history.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
            _, seconds, _ = ask(url, {"model": model, "messages": history, "max_tokens": args.chat_tokens,
                                      "temperature": 0})
            total += seconds
            # the same assistant text for both entries, so both resend the same history
            history.append({"role": "assistant", "content": f"Answer {turn}: " + "details " * (args.chat_tokens // 2)})
        return total

    times: dict[str, list[float]] = {"cached": [], "uncached": []}
    for r in range(args.rounds):
        for m in (("cached", "uncached") if r % 2 == 0 else ("uncached", "cached")):
            times[m].append(conversation(m))
    c, u = statistics.median(times["cached"]), statistics.median(times["uncached"])
    return [[f"(b) {args.turns}-turn chat, history resent", "seconds for the conversation, median", f"{c:.1f}",
             f"{u:.1f}", paired_ratio(times["cached"], times["uncached"]), str(args.rounds)]]


def workload_c(url: str, args: argparse.Namespace) -> list[list[str]]:
    def body(n: int) -> dict[str, Any]:
        return {"model": "cached", "messages": [{"role": "user", "content": GSM}], "max_tokens": args.chat_tokens,
                "temperature": 0.7, "seed": 1, "n": n}

    one, eight = [], []
    for _ in range(args.rounds):
        one.append(ask(url, body(1))[1])
        eight.append(ask(url, body(8))[1])
    o, e = statistics.median(one), statistics.median(eight)
    return [[f"(c) n = 8 samples of one question, {args.chat_tokens} tokens each", "seconds: n = 8 / n = 1",
             f"{e:.1f} / {o:.1f}", "-", f"{e / o:.2f}x of one sample", str(args.rounds)]]


def workloads(text: str) -> str:
    if not text or set(text) - set("abcd"):
        raise argparse.ArgumentTypeError("give letters of a, b, c, d (e.g. 'ad')")
    return text


def ensembles(model: str) -> list[dict[str, Any]]:
    """Exchange-of-Thought and mixture-of-agents over one entry (two differently prompted agents each)."""
    agents = [{"model": model, "name": "careful", "system": "You are a careful assistant. Check every step."},
              {"model": model, "name": "quick", "system": "You are a quick, intuitive assistant.", "seed": 7}]
    return [{"name": f"eot-{model}", "strategy": "exchange_of_thought", "topology": "memory", "answer": "auto",
             "max_rounds": 3, "members": agents},
            {"name": f"moa-{model}", "strategy": "mixture_of_agents", "layers": 1, "aggregator": model,
             "members": agents}]


def workload_d(url: str, args: argparse.Namespace) -> list[list[str]]:
    rows = []
    questions = QUESTIONS[: args.ensemble_questions]
    for strategy in ("eot", "moa"):
        times: dict[str, list[float]] = {"cached": [], "uncached": []}
        for i, q in enumerate(questions):
            for m in (("cached", "uncached") if i % 2 == 0 else ("uncached", "cached")):
                times[m].append(ask(url, {"model": f"{strategy}-{m}", "messages": [{"role": "user", "content": q}],
                                          "max_tokens": args.chat_tokens, "temperature": 0})[1])
        c, u = statistics.median(times["cached"]), statistics.median(times["uncached"])
        rows.append([f"(d) {strategy}, one-line questions", "seconds a question, median", f"{c:.1f}", f"{u:.1f}",
                     paired_ratio(times["cached"], times["uncached"]), str(len(questions))])
    return rows


WORKLOADS = {"b": workload_b, "c": workload_c, "d": workload_d}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="a config model whose source is a GGUF (llama_cpp) or a prepared checkpoint (transformers)")
    p.add_argument("--engine", choices=("llama_cpp", "transformers"), default="llama_cpp")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--system-tokens", type=int, default=1500)
    p.add_argument("--questions", type=int, default=16)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--chat-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ensemble-questions", type=int, default=10)
    p.add_argument("--workloads", default="abcd", type=workloads, help="which of a, b, c, d to run (default: all)")
