"""`chorus bench engine`: decode throughput of chorus's engine, printed as a table.

In one run, same model, threads and dtype, each figure the best of ``--rounds`` rounds (this machine
is shared and noisy; the best round is the least disturbed one):

1. in-process: batch-1 decode tokens/s of chorus's engine vs plain ``model.generate()``, and the
   aggregate tokens/s of ``--concurrency`` concurrent streams on the engine;
2. over HTTP (a ``chorus serve`` subprocess, streaming SSE clients): 1 stream vs ``--concurrency``
   streams, with time to first token;
3. the same HTTP load against ``transformers serve --continuous-batching`` on the same checkpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

PROMPT = "Write a long story about a dragon who learns to sing."


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


def _best(rounds: int, run: Callable[[], Result]) -> Result:
    return max((run() for _ in range(rounds)), key=lambda r: r.tok_s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- in-process ----

def _in_process(spec, tokens: int, concurrency: int, rounds: int) -> list[Row]:  # type: ignore[no-untyped-def]
    import torch

    from engines.base import GenerationRequest, SamplingParams
    from engines.transformers_engine import TransformersEngine

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
        ref = _best(rounds, generate)
        b1 = max([await streams(1) for _ in range(rounds)], key=lambda r: r.tok_s)
        bn = max([await streams(concurrency) for _ in range(rounds)], key=lambda r: r.tok_s)
        await engine.aclose()
        return [Row("model.generate(), batch 1", ref, "1.00x"),
                Row("chorus engine, 1 stream", b1, f"{b1.tok_s / ref.tok_s:.2f}x vs generate()"),
                Row(f"chorus engine, {concurrency} streams (aggregate)", bn, f"{bn.tok_s / b1.tok_s:.2f}x vs 1 stream")]

    return asyncio.run(main())


# ---- over HTTP ----

async def _http_stream(client: httpx.AsyncClient, url: str, model: str, tokens: int, extra: dict) -> tuple[float, int]:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
            "temperature": 0, "stream": True, **extra}
    t0 = time.perf_counter()
    ttft, usage, chunks = None, None, 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            for c in chunk.get("choices", []):
                if c.get("delta", {}).get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    chunks += 1
    return ttft or 0.0, usage if usage is not None else chunks  # no usage: one token per content chunk


def _http_load(url: str, model: str, tokens: int, k: int, extra: dict) -> Result:
    async def main() -> Result:
        async with httpx.AsyncClient(timeout=600) as client:
            t0 = time.perf_counter()
            res = await asyncio.gather(*(_http_stream(client, url, model, tokens, extra) for _ in range(k)))
            wall = time.perf_counter() - t0
        total = sum(n for _, n in res)
        return Result(total / wall, [t for t, _ in res], total)

    return asyncio.run(main())


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not become ready")


def _server_rows(label: str, cmd: list[str], port: int, model: str, extra: dict, args: argparse.Namespace,
                 env: dict[str, str], log: Path) -> list[Row]:
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
        try:
            _wait_ready(url, proc)
            _http_load(url, model, 4, 1, extra)  # warm-up
            one = _best(args.rounds, lambda: _http_load(url, model, args.tokens, 1, extra))
            many = _best(args.rounds, lambda: _http_load(url, model, args.tokens, args.concurrency, extra))
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return [Row(f"{label}, 1 stream", one, "1.00x"),
            Row(f"{label}, {args.concurrency} streams (aggregate)", many, f"{many.tok_s / one.tok_s:.2f}x vs 1 stream")]


def main(args: argparse.Namespace) -> int:
    import torch

    from engines.prepare import prepare_model
    from server.config import load_config

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
        port = _free_port()
        rows += _server_rows("chorus serve", [sys.executable, "-m", "server.cli", "serve", "--config", str(cfg),
                                              "--port", str(port), "--no-prepare", "--log-level", "warning"],
                             port, spec.name, {"ignore_eos": True, "stream_options": {"include_usage": True}},
                             args, env, Path(tmp) / "chorus.log")
        if not args.skip_transformers_serve:
            port = _free_port()
            exe = Path(sys.executable).with_name("transformers")
            # it rejects ignore_eos and stream_options; a generation_config forces the same length
            gen = {"generation_config": json.dumps({"min_new_tokens": args.tokens, "max_new_tokens": args.tokens,
                                                    "do_sample": False})}
            try:
                rows += _server_rows("transformers serve --continuous-batching",
                                     [str(exe), "serve", str(path), "--continuous-batching", "--device", "cpu",
                                      "--dtype", "float32", "--port", str(port)], port, str(path), gen, args, env,
                                     Path(tmp) / "tserve.log")
            except Exception as exc:  # noqa: BLE001 - the table says why the rows are missing
                print(f"transformers serve failed: {exc}\n{(Path(tmp) / 'tserve.log').read_text()[-1500:]}",
                      file=sys.stderr)
    print()
    print("| run | tokens/s | ratio | TTFT p50 (s) | TTFT max (s) | tokens |")
    print("|---|---:|---|---:|---:|---:|")
    for r in rows:
        t = r.res.ttfts
        p50, mx = (f"{statistics.median(t):.2f}", f"{max(t):.2f}") if t else ("-", "-")
        print(f"| {r.name} | {r.res.tok_s:.1f} | {r.ratio} | {p50} | {mx} | {r.res.tokens} |")
    return 0
