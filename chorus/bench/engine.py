"""`chorus bench engine`: decode throughput of chorus's engine, printed as a table.

In one run, same model, threads and dtype, each figure the best of ``--rounds`` rounds (this machine
is shared and noisy; the best round is the least disturbed one):

1. in-process: batch-1 decode tokens/s of chorus's engine vs plain ``model.generate()``, and the
   aggregate tokens/s of ``--concurrency`` concurrent streams on the engine (rounds interleaved);
2. over HTTP, streaming SSE clients against a ``chorus serve`` subprocess and a
   ``transformers serve --continuous-batching`` subprocess on the same checkpoint (and, with ``--vllm``, vLLM's
   CPU build), all up at once and the rounds alternating between them: 1 stream vs ``--concurrency`` streams,
   with time to first token.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from chorus.clients.local import free_port, spawn, stop_all, vllm_command, wait_ready
from chorus.engines.core.spec import ModelSpec

PROMPT = "Write a long story about a dragon who learns to sing."
_NONCE = itertools.count()


@dataclass
class Result:
    tok_s: float
    ttfts: list[float]
    tokens: int


@dataclass
class Row:
    name: str
    res: Result
    ratio: str


# ---- in-process ----

def _in_process(spec: ModelSpec, tokens: int, concurrency: int, rounds: int) -> list[Row]:
    import torch

    from chorus.engines.core.base import GenerationRequest, SamplingParams
    from chorus.engines.transformers.engine import TransformersEngine

    async def main() -> list[Row]:
        engine = TransformersEngine.load(spec)
        await engine.start()
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)

        async def one_stream() -> tuple[float, int]:
            t0, ttft, n = time.perf_counter(), None, 0
            async for d in engine.stream(GenerationRequest(ids, params)):
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                n += len(d.token_ids)
            return ttft or 0.0, n

        async def streams(k: int) -> Result:
            t0 = time.perf_counter()
            res = await asyncio.gather(*(one_stream() for _ in range(k)))
            wall = time.perf_counter() - t0
            return Result(sum(n for _, n in res) / wall, [t for t, _ in res], sum(n for _, n in res))

        def generate() -> Result:
            with torch.inference_mode():
                t0 = time.perf_counter()
                out = engine.model.generate(torch.tensor([ids]), max_new_tokens=tokens, min_new_tokens=tokens,
                                            do_sample=False)
                n = out.shape[1] - len(ids)
            return Result(n / (time.perf_counter() - t0), [], n)

        await streams(1)  # warm-up
        generate()
        refs, b1s, bns = [], [], []
        for _ in range(rounds):  # interleaved, so drift in machine load hits all three alike
            refs.append(generate())
            b1s.append(await streams(1))
            bns.append(await streams(concurrency))
        ref, b1, bn = (max(rs, key=lambda r: r.tok_s) for rs in (refs, b1s, bns))
        await engine.aclose()
        return [Row("model.generate(), batch 1", ref, "1.00x"),
                Row("chorus engine, 1 stream", b1, f"{b1.tok_s / ref.tok_s:.2f}x vs generate()"),
                Row(f"chorus engine, {concurrency} streams (aggregate)", bn, f"{bn.tok_s / b1.tok_s:.2f}x vs 1 stream")]

    return asyncio.run(main())


# ---- over HTTP ----

async def chat_chunks(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                      headers: dict[str, str] | None = None) -> AsyncGenerator[dict[str, Any], None]:
    """The chunks of one streamed chat completion (``body`` asks for the stream), as they arrive."""
    async with client.stream("POST", url + "/v1/chat/completions", headers=headers, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                yield json.loads(line[5:])


async def _http_stream(client: httpx.AsyncClient, url: str, model: str, tokens: int, extra: dict,
                       unique: bool = False) -> tuple[float, int]:
    messages = [{"role": "user", "content": PROMPT}]
    if unique:  # a system message of its own first: no server can reuse an earlier request's prompt cache
        messages.insert(0, {"role": "system", "content": f"Session {next(_NONCE)}-{os.getpid()}."})
    body = {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0, "stream": True, **extra}
    t0 = time.perf_counter()
    ttft, usage, chunks = None, None, 0
    async for chunk in chat_chunks(client, url, body):
        if chunk.get("usage"):
            usage = chunk["usage"]["completion_tokens"]
        for c in chunk.get("choices", []):
            if c.get("delta", {}).get("content"):
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                chunks += 1
    return ttft or 0.0, usage if usage is not None else chunks  # no usage: one token per content chunk


def settle(quiet: float = 0.1, timeout: float = 5.0) -> None:
    """Wait until the machine is idle: two 0.1 s windows in a row with the CPUs less than ``quiet`` busy (at most
    ``timeout`` seconds; one second where /proc/stat is not there). A server may still be working after its
    last response: llama-server saves the finished prompt's KV cells to its prompt cache, which took CPU from
    whichever server was measured next (its first token came 0.15 s later, measured)."""
    def busy() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields) - fields[3] - fields[4], sum(fields)  # all but idle and iowait; all

    if not Path("/proc/stat").exists():
        time.sleep(1.0)
        return
    end = time.monotonic() + timeout
    calm = 0
    while calm < 2 and time.monotonic() < end:
        b0, t0 = busy()
        time.sleep(0.1)
        b1, t1 = busy()
        calm = calm + 1 if (b1 - b0) < quiet * max(t1 - t0, 1) else 0


def http_load(url: str, model: str, tokens: int, k: int, extra: dict, unique: bool = False) -> Result:
    """``k`` streams at once, started on an idle machine (`settle`); ``unique``: each request's prompt starts
    with text of its own (prefix caches miss)."""
    settle()
    async def main() -> Result:
        async with httpx.AsyncClient(timeout=600) as client:
            t0 = time.perf_counter()
            res = await asyncio.gather(*(_http_stream(client, url, model, tokens, extra, unique) for _ in range(k)))
            wall = time.perf_counter() - t0
        total = sum(n for _, n in res)
        return Result(total / wall, [t for t, _ in res], total)

    return asyncio.run(main())


@dataclass
class Server:
    label: str
    cmd: list[str]
    port: int
    model: str
    extra: dict
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def stop_servers(servers: list[Server]) -> None:
    """Each started server stopped with its process group (vLLM's engine processes with it)."""
    stop_all([srv.proc for srv in servers if srv.proc is not None], grace=30)


def _http_rows(servers: list[Server], args: argparse.Namespace, env: dict[str, str]) -> list[Row]:
    """Both servers run at once (idle, each uses no CPU); rounds alternate between them."""
    try:
        for srv in servers:
            srv.proc = spawn(srv.cmd, stdout=open(srv.log, "w"), stderr=subprocess.STDOUT, env=env)
        ready = []
        for srv in servers:
            try:
                wait_ready(srv.url + "/v1/models", srv.proc)
                http_load(srv.url, srv.model, 4, 1, srv.extra)  # warm-up
                ready.append(srv)
            except Exception as exc:
                print(f"{srv.label} failed: {exc}\n{srv.log.read_text()[-1500:]}", file=sys.stderr)
        results: dict[tuple[str, int], list[Result]] = {}
        for _ in range(args.rounds):
            for k in (1, args.concurrency):
                for srv in ready:
                    results.setdefault((srv.label, k), []).append(
                        http_load(srv.url, srv.model, args.tokens, k, srv.extra))
    finally:
        stop_servers(servers)
    rows = []
    for srv in ready:
        one = max(results[(srv.label, 1)], key=lambda r: r.tok_s)
        many = max(results[(srv.label, args.concurrency)], key=lambda r: r.tok_s)
        rows += [Row(f"{srv.label}, 1 stream", one, "1.00x"),
                 Row(f"{srv.label}, {args.concurrency} streams (aggregate)", many,
                     f"{many.tok_s / one.tok_s:.2f}x vs 1 stream")]
    return rows


def main(args: argparse.Namespace) -> int:
    import torch

    from chorus.config import load_config
    from chorus.engines.core.registry import prepare_model

    torch.set_num_threads(args.threads)
    config = load_config(args.config)
    spec = config.model(args.model)
    path = prepare_model(spec, log=lambda m: None)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    print(f"chorus bench engine: {spec.name}, {spec.dtype}, {args.threads} threads, {args.tokens} tokens per "
          f"request, best of {args.rounds} rounds", flush=True)
    rows = _in_process(spec, args.tokens, args.concurrency, args.rounds)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "bench.yaml"
        cfg.write_text(json.dumps({"models": [spec.model_dump(exclude_none=True)]}))
        port = free_port()
        servers = [Server("chorus serve", [sys.executable, "-m", "chorus", "serve", "--config", str(cfg),
                                           "--port", str(port), "--no-prepare", "--log-level", "warning"],
                          port, spec.name, {"ignore_eos": True, "stream_options": {"include_usage": True}},
                          Path(tmp) / "chorus.log")]
        if not args.skip_transformers_serve:
            port = free_port()
            # it rejects ignore_eos and stream_options; a generation_config forces the same length
            gen = {"generation_config": json.dumps({"min_new_tokens": args.tokens, "max_new_tokens": args.tokens,
                                                    "do_sample": False})}
            servers.append(Server("transformers serve --continuous-batching",
                                  [str(Path(sys.executable).with_name("transformers")), "serve", str(path),
                                   "--continuous-batching", "--device", "cpu", "--dtype", "float32",
                                   "--port", str(port)], port, str(path), gen, Path(tmp) / "tserve.log"))
        if args.vllm:  # vLLM's CPU build (`make vllm`) on the same checkpoint, float32, as tests/integration runs it
            port = free_port()
            servers.append(Server("vLLM 0.32.0 (CPU build)",
                                  vllm_command(args.vllm, path, spec.name, port,
                                               max_model_len=min(spec.max_model_len or 2048, 2048)), port, spec.name,
                                  {"ignore_eos": True, "stream_options": {"include_usage": True}},
                                  Path(tmp) / "vllm.log"))
            env = {**env, "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1")}
        rows += _http_rows(servers, args, env)
    print()
    print("| run | tokens/s | ratio | TTFT p50 (s) | TTFT max (s) | tokens |")
    print("|---|---:|---|---:|---:|---:|")
    for r in rows:
        t = r.res.ttfts
        p50, mx = (f"{statistics.median(t):.2f}", f"{max(t):.2f}") if t else ("-", "-")
        print(f"| {r.name} | {r.res.tok_s:.1f} | {r.ratio} | {p50} | {mx} | {r.res.tokens} |")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--skip-transformers-serve", action="store_true")
    p.add_argument("--vllm", metavar="PYTHON", help="also vLLM's CPU build, run by this Python (make vllm: "
                   ".venv-vllm/bin/python) on the same checkpoint")
