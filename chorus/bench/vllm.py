"""`chorus bench vllm`: chorus beside vLLM's CPU build on this machine, same checkpoint, same prompts, one run.

1. **engines**: ``chorus serve`` on the transformers engine (the prepared checkpoint, float32), ``chorus serve`` on
   the llama.cpp engine (the model's GGUF as packaged) and vLLM's CPU build (``--vllm PYTHON``: the prepared
   checkpoint, float32), all started at once; each is measured while the others are idle (`settle`), rounds
   interleaved: ``k`` streamed requests of ``--tokens`` tokens (``ignore_eos``, prompts of their own) for each k of
   ``--streams``. Per server and k: aggregate tokens/s (the median of ``--rounds`` rounds, with their range),
   TTFT p50 / p90 over every round's requests, and the ratio to vLLM at the same k.
2. **gateway**: the same vLLM asked directly and through a chorus gateway in front of it (``engine: remote``, the
   same checkpoint's tokenizer): at concurrency 1, ``--requests`` short non-streamed requests alternating direct /
   gateway: the p50 latency each way and the gateway's added p50 with a bootstrap 95% interval (pairs resampled);
   at concurrency ``--clients``, requests/s in ``--rounds`` interleaved windows of ``--seconds``: the gateway's
   throughput as a share of vLLM's (the median of the rounds' ratios, with their range).

Everything shares this machine's cores (servers, gateway and clients): the figures are ratios within the run.
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
from pathlib import Path
from typing import Any

import httpx

from chorus.bench.engine import Result, Server, http_load, settle, stop_servers
from chorus.clients.local import free_port, markdown_table, spawn, vllm_command, wait_ready

STREAMED = {"ignore_eos": True, "stream_options": {"include_usage": True}}


def q90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[8] if len(xs) >= 2 else (xs[0] if xs else float("nan"))


def engine_rows(servers: list[Server], args: argparse.Namespace) -> list[list[object]]:
    results: dict[tuple[str, int], list[Result]] = {}
    for r in range(args.rounds):
        for k in args.streams:
            for srv in servers:
                res = http_load(srv.url, srv.model, args.tokens, k, srv.extra, unique=True)
                results.setdefault((srv.label, k), []).append(res)
                print(f"round {r + 1}, {srv.label}, {k} streams: {res.tok_s:.1f} tok/s", file=sys.stderr, flush=True)
    peer = servers[-1].label  # vLLM
    rows: list[list[object]] = []
    for k in args.streams:
        ref = statistics.median(x.tok_s for x in results[(peer, k)])
        for srv in servers:
            runs = results[(srv.label, k)]
            rates = [x.tok_s for x in runs]
            ttft = [t for x in runs for t in x.ttfts]
            med = statistics.median(rates)
            rows.append([srv.label, k, f"{med:.1f}", f"{min(rates):.1f}-{max(rates):.1f}", f"{med / ref:.2f}x",
                         f"{statistics.median(ttft):.2f}", f"{q90(ttft):.2f}", sum(x.tokens for x in runs)])
    return rows


async def latency(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    r = await http.post(url + "/v1/chat/completions", json=body)
    r.raise_for_status()
    return time.perf_counter() - t0


def added_p50(direct: list[float], via: list[float], resamples: int = 5000) -> tuple[float, float, float]:
    """The gateway's added p50 (ms) and a bootstrap 95% interval, the alternating pairs resampled together."""
    rng = random.Random(0)
    n = len(direct)
    point = (statistics.median(via) - statistics.median(direct)) * 1000
    stats = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        stats.append((statistics.median(via[i] for i in idx) - statistics.median(direct[i] for i in idx)) * 1000)
    stats.sort()
    return point, stats[int(0.025 * resamples)], stats[int(0.975 * resamples)]


async def gateway_rows(vllm: Server, gw: Server, args: argparse.Namespace) -> tuple[list[list[object]], str]:
    def body(i: int, model: str) -> dict[str, Any]:
        return {"model": model, "messages": [{"role": "user", "content": f"Say hello to guest {i % 50}."}],
                "max_tokens": args.gateway_tokens, "temperature": 0.0}

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as http:
        for srv in (vllm, gw):  # warm: each prompt of the loop once
            for i in range(50):
                await latency(http, srv.url, body(i, srv.model))
        settle()
        direct: list[float] = []
        via: list[float] = []
        for i in range(args.requests):
            pair = [(vllm, direct), (gw, via)] if i % 2 == 0 else [(gw, via), (vllm, direct)]
            for srv, out in pair:
                out.append(await latency(http, srv.url, body(i, srv.model)))

        async def window(srv: Server) -> float:
            done = 0
            end = time.perf_counter() + args.seconds

            async def client(c: int) -> None:
                nonlocal done
                i = c
                while time.perf_counter() < end:
                    await latency(http, srv.url, body(i, srv.model))
                    done += 1
                    i += args.clients
            t0 = time.perf_counter()
            await asyncio.gather(*(client(c) for c in range(args.clients)))
            return done / (time.perf_counter() - t0)

        rates: dict[str, list[float]] = {vllm.label: [], gw.label: []}
        for r in range(args.rounds):
            for srv in (vllm, gw) if r % 2 == 0 else (gw, vllm):
                settle()
                rates[srv.label].append(await window(srv))
    point, lo, hi = added_p50(direct, via)
    ratios = [g / d for g, d in zip(rates[gw.label], rates[vllm.label])]
    rows: list[list[object]] = [[vllm.label, f"{statistics.median(direct) * 1000:.1f}", f"{q90(direct) * 1000:.1f}", "-",
             f"{statistics.median(rates[vllm.label]):.2f}", "1.00x"],
            [gw.label, f"{statistics.median(via) * 1000:.1f}", f"{q90(via) * 1000:.1f}",
             f"{point:+.1f} [{lo:+.1f}, {hi:+.1f}]", f"{statistics.median(rates[gw.label]):.2f}",
             f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"]]
    note = (f"concurrency 1: {args.requests} requests each way, alternating; concurrency {args.clients}: "
            f"{args.rounds} windows of {args.seconds:g} s each way, interleaved; {args.gateway_tokens} tokens per "
            f"answer, greedy, non-streamed")
    return rows, note


def servers_for(spec: Any, path: Path, args: argparse.Namespace, tmp: Path) -> list[Server]:
    """chorus serve (transformers), chorus serve (llama.cpp, when the model has a GGUF source), vLLM, and a
    chorus gateway in front of that vLLM (last)."""
    def chorus(label: str, model: dict[str, Any], key: str) -> Server:
        port = free_port()
        cfg = tmp / f"{key}.yaml"
        cfg.write_text(json.dumps({"server": {"limits": {"max_concurrent_requests": 1024}}, "models": [model]}))
        return Server(label, [sys.executable, "-m", "chorus", "serve", "--config", str(cfg), "--port", str(port),
                             "--no-prepare", "--log-level", "warning"], port, spec.name, STREAMED, tmp / f"{key}.log")

    top = max(args.streams)
    length = min(spec.max_model_len or 2048, 2048)
    out = [chorus("chorus serve, transformers engine",
                  {**spec.model_dump(exclude_none=True), "max_batch_size": top, "max_model_len": length,
                   "dtype": "float32"}, "tf")]  # like vLLM here (--dtype float32), whatever the config says
    if spec.source and spec.derive is None:
        llama = {"name": spec.name, "engine": "llama_cpp", "source": spec.sources, "max_batch_size": top,
                 "max_model_len": length, "llama_cpp": {"threads": args.threads}}
        if spec.gguf is not None:
            llama["gguf"] = spec.gguf.model_dump(exclude_none=True)
        out.append(chorus("chorus serve, llama.cpp engine (GGUF)", llama, "llama"))
    port = free_port()
    out.append(Server("vLLM 0.32.0 (CPU build)",
                      vllm_command(args.vllm, path, spec.name, port, "--max-num-seqs", str(top),
                                   max_model_len=length),
                      port, spec.name, STREAMED, tmp / "vllm.log"))
    remote = {"name": "via-gateway", "engine": "remote", "max_model_len": length,
              "remote": {"replicas": [out[-1].url + "/v1"], "model": spec.name, "tokenizer": str(path),
                         "read_timeout_s": 600}}
    out.append(chorus("chorus gateway in front of vLLM", remote, "gateway"))
    out[-1].model = "via-gateway"
    return out


def main(args: argparse.Namespace) -> int:
    from chorus.config import load_config
    from chorus.engines.core.registry import prepare_model

    spec = load_config(args.config).model(args.model)
    path = prepare_model(spec, log=lambda m: None)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "VLLM_LOGGING_LEVEL": "WARNING",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    with tempfile.TemporaryDirectory(prefix="chorus-bench-vllm-") as d:
        servers = servers_for(spec, path, args, Path(d))
        try:
            for srv in servers:
                srv.proc = spawn(srv.cmd, stdout=open(srv.log, "w"), stderr=subprocess.STDOUT, env=env)
            for srv in servers:
                try:
                    wait_ready(srv.url + "/v1/models", srv.proc, timeout=900)
                except RuntimeError:
                    print(srv.log.read_text()[-3000:], file=sys.stderr)
                    raise
            engines, gw = servers[:-1], servers[-1]
            for srv in engines:
                http_load(srv.url, srv.model, 4, 1, srv.extra)  # warm-up
            rows = engine_rows(engines, args) if args.streams else []
            grows, note = asyncio.run(gateway_rows(engines[-1], gw, args)) if args.requests else ([], "")
        finally:
            stop_servers(servers)
    print(f"chorus bench vllm: {spec.name}, {os.cpu_count()} cores shared by every server and the clients, "
          f"{args.threads} threads each for chorus's engines; {args.tokens} tokens per streamed request, "
          f"{args.rounds} rounds interleaved")
    if rows:
        print()
        print(markdown_table(["server", "streams", "tokens/s (median)", "range", "vs vLLM", "TTFT p50 s",
                              "TTFT p90 s", "tokens"], rows))
    if grows:
        print(f"\n{note}\n")
        print(markdown_table(["path", "p50 ms (c=1)", "p90 ms (c=1)", "added p50 ms [95% CI]",
                              f"requests/s (c={args.clients})", "vs vLLM (range)"], grows))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--vllm", metavar="PYTHON", default=".venv-vllm/bin/python",
                   help="the Python of vLLM's CPU build (make vllm)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per streamed request (engines)")
    p.add_argument("--streams", type=int, nargs="*", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--requests", type=int, default=200, help="gateway: requests each way at concurrency 1 (0: skip)")
    p.add_argument("--gateway-tokens", type=int, default=4, help="gateway: tokens per answer")
    p.add_argument("--clients", type=int, default=32, help="gateway: concurrent clients for requests/s")
    p.add_argument("--seconds", type=float, default=15.0, help="gateway: each requests/s window")
