"""`chorus bench load`: a `chorus serve` process under N concurrent clients for a fixed time.

Clients mix ordinary requests (streaming and not), clients that disconnect mid-stream, and invalid
requests (bad JSON, bad parameters, unknown models). Printed: requests by outcome, errors by kind,
latency percentiles of the successful ones, the server's memory (RSS) over time (peak, and the first
vs the last part of the run: flat means nothing accumulates), and the sessions left open at the end.
``--model fake`` runs the fake engine (measures the gateway); ``--model smollm2-135m-instruct`` the real model.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from chorus.clients.local import free_port, wait_ready

FAKE_CONFIG = """
server: {limits: {max_concurrent_requests: 512}, log: {level: warning}}
models:
  - {name: fake, engine: fake, fake: {delay: 0.002, max_model_len: 4096}}
"""


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


async def client_loop(http: httpx.AsyncClient, model: str, until: float, rng: random.Random, outcomes: Counter[str],
                      latencies: list[float], max_tokens: int) -> None:
    msgs = [{"role": "user", "content": "Tell me about the sea."}]
    while time.monotonic() < until:
        roll = rng.random()
        t0 = time.perf_counter()
        try:
            if roll < 0.05:
                r = await http.post(
                    "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
                )
                outcomes[f"invalid: {r.status_code} {r.json()['error']['code']}"] += 1
            elif roll < 0.10:
                r = await http.post("/v1/chat/completions", json={"model": model, "messages": msgs, "temperature": 9})
                outcomes[f"invalid: {r.status_code} {r.json()['error']['code']}"] += 1
            elif roll < 0.15:
                r = await http.post("/v1/chat/completions", json={"model": "nope", "messages": msgs})
                outcomes[f"invalid: {r.status_code} {r.json()['error']['code']}"] += 1
            elif roll < 0.30:  # goes away mid-stream
                body = {
                    "model": model,
                    "messages": msgs,
                    "max_tokens": max_tokens * 4,
                    "stream": True,
                    "ignore_eos": True,
                }
                async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    n = 0
                    async for _ in r.aiter_lines():
                        n += 1
                        if n > 6:
                            break
                outcomes["disconnected mid-stream"] += 1
            elif roll < 0.65:
                body = {"model": model, "messages": msgs, "max_tokens": max_tokens, "stream": True}
                async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    lines = [ln async for ln in r.aiter_lines() if ln.startswith("data:")]
                ok = r.status_code == 200 and lines and lines[-1] == "data: [DONE]" and '"error"' not in lines[-2]
                outcomes["ok (stream)" if ok else f"failed stream: {r.status_code}"] += 1
                if ok:
                    latencies.append(time.perf_counter() - t0)
            else:
                r = await http.post(
                    "/v1/chat/completions", json={"model": model, "messages": msgs, "max_tokens": max_tokens}
                )
                outcomes["ok" if r.status_code == 200 else f"error: {r.status_code} {r.json()['error']['code']}"] += 1
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - t0)
        except httpx.HTTPError as exc:
            outcomes[f"transport error: {type(exc).__name__}"] += 1


async def _run(args: argparse.Namespace) -> str:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "chorus", "serve", "--port", str(port), "--log-level", "warning"]
        if args.model == "fake":
            cfg = Path(tmp) / "fake.yaml"
            cfg.write_text(FAKE_CONFIG)
            cmd += ["--config", str(cfg)]
        elif args.config:
            cmd += ["--config", args.config]
        # started before any load is sent, so its blocking start costs nothing measured
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,  # noqa: ASYNC220
                                env=os.environ.copy())
        url = f"http://127.0.0.1:{port}"
        try:
            await asyncio.to_thread(wait_ready, url + "/health", proc)
            samples: list[tuple[float, float]] = []
            outcomes: Counter[str] = Counter()
            latencies: list[float] = []
            start = time.monotonic()
            until = start + args.seconds

            async def watch() -> None:
                while time.monotonic() < until:
                    samples.append((time.monotonic() - start, rss_mib(proc.pid)))
                    await asyncio.sleep(1.0)

            limits = httpx.Limits(max_connections=args.clients * 2, max_keepalive_connections=args.clients)
            async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
                rng = random.Random(0)
                await asyncio.gather(watch(), *(client_loop(http, args.model, until, random.Random(rng.random()),
                                                            outcomes, latencies, args.max_tokens)
                                                for _ in range(args.clients)))
            await asyncio.sleep(1.0)
            async with httpx.AsyncClient() as http:
                health = (await http.get(url + "/health")).json()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    lat = sorted(latencies) or [0.0]
    pct = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))]  # noqa: E731
    third = max(1, len(samples) // 3)
    first = statistics.fmean(r for _, r in samples[:third]) if samples else 0.0
    last = statistics.fmean(r for _, r in samples[-third:]) if samples else 0.0
    total = sum(outcomes.values())
    lines = [f"chorus bench load: model {args.model}, {args.clients} clients, {args.seconds:g} s, "
             f"max_tokens {args.max_tokens}", "", "| outcome | requests |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(outcomes.items(), key=lambda kv: -kv[1])]
    lines += [
        f"| **total** | {total} ({total / args.seconds:.1f}/s) |",
        "",
        f"successful requests: p50 {pct(0.5) * 1000:.0f} ms, p99 {pct(0.99) * 1000:.0f} ms, "
        f"max {lat[-1] * 1000:.0f} ms",
        f"server RSS: start {samples[0][1] if samples else 0:.0f} MiB, "
        f"peak {max((r for _, r in samples), default=0):.0f} MiB, "
        f"mean of the first third {first:.0f} MiB vs the last third {last:.0f} MiB ({last - first:+.0f} MiB)",
        f"sessions open after the run: {sum(m.get('active_sessions', 0) for m in health['models'].values())}",
    ]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    print(asyncio.run(_run(args)))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="fake", help="fake (the gateway alone) or a model of the config")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--max-tokens", type=int, default=32)
