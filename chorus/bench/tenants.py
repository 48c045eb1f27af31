"""`chorus bench tenants`: can one key time another key's prompt? Time to first token (TTFT) of a second key that
sends the same long system prompt right after the first key, against the first key's cold request and its own
warm one, on each engine.

One ``chorus serve`` per engine with two keys (``alpha``, ``bravo``) and the default ``server.prefix_cache.share:
key``: SmolLM2 on ``llama_cpp`` (its GGUF), on ``transformers`` (its prepared checkpoint), and ``remote`` (a
gateway in front of a ``chorus worker`` serving the transformers model; the tenant travels as ``cache_salt``).
Each round draws a fresh system prompt of about ``--system-tokens`` tokens (so alpha's first request is cold), then:
alpha (cold), bravo with the same system prompt and another question (the probe), alpha again with a third
question (warm: its own prefix). Streamed, greedy, 2 tokens; each request starts on an idle machine. Rows: the
median TTFTs, bravo's TTFT over alpha's cold one and alpha's warm over cold (paired by round: geometric mean and
95% t interval), and the prompt tokens each was served from the cache. With tenants apart, bravo / cold is 1 within
noise and bravo is served 0 cached tokens; ``--share all`` shows the side channel the default closes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from chorus.bench.cache import QUESTIONS, ask, system_prompt
from chorus.bench.llama import paired_ratio
from chorus.clients.local import free_port, wait_ready


def hash_key(raw: str) -> str:
    """A key's SHA-256 as the config stores it (server/gateway/auth.py's rule; the bench layer does not import server)."""
    return hashlib.sha256(raw.encode()).hexdigest()


KEYS = {"alpha": "sk-bench-alpha", "bravo": "sk-bench-bravo"}
ENGINES = ("llama_cpp", "transformers", "remote")


def serve(stack: ExitStack, tmp: Path, command: str, config: dict[str, Any], env: dict[str, str]) -> str:
    """A ``chorus serve`` (or ``worker``) process with this config, stopped when ``stack`` closes; its URL."""
    path = tmp / f"{command}-{len(list(tmp.iterdir()))}.json"
    path.write_text(json.dumps(config))
    port = free_port()
    log = open(tmp / f"{path.stem}.log", "w")
    stack.callback(log.close)
    proc = subprocess.Popen([sys.executable, "-m", "chorus", command, "--config", str(path), "--port", str(port),
                             "--no-prepare", "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT, env=env)

    def stop() -> None:
        proc.terminate()
        proc.wait(30)

    stack.callback(stop)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url + "/health", proc, timeout=600)
    return url


def model_entry(engine: str, args: argparse.Namespace, stack: ExitStack, tmp: Path, env: dict[str, str]) -> dict[str, Any]:
    from chorus.config import load_config

    base = load_config(args.config).model(args.model)
    if engine == "llama_cpp":
        return {"name": "smol", "engine": "llama_cpp", "max_batch_size": 4, "max_model_len": 4096,
                **({"source": base.sources} if base.source else {"path": base.path}),
                **({"gguf": base.gguf.model_dump()} if base.gguf else {}), "llama_cpp": {"threads": args.threads}}
    local = {"name": "smol", "engine": "transformers", "path": str(base.checkpoint_dir()), "dtype": base.dtype,
             "max_batch_size": 4, "max_model_len": 4096}
    if engine == "transformers":
        return local
    worker = serve(stack, tmp, "worker", {"models": [local], "auth": {"keys": [
        {"name": "gateway", "sha256": hash_key("sk-bench-gateway")}]}}, env)
    return {"name": "smol", "engine": "remote", "max_model_len": 4096,
            "remote": {"replicas": [worker + "/v1"], "model": "smol", "tokenizer": str(base.checkpoint_dir()),
                       "api_key_env": "CHORUS_BENCH_WORKER_KEY", "read_timeout_s": 600}}


def measure(url: str, rounds: int, tokens: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {k: [] for k in ("cold", "probe", "warm", "probe_cached", "warm_cached")}
    for r in range(rounds):
        system = f"Playbook {r} of team alpha, confidential. " + system_prompt(tokens)

        def one(key: str, question: str, system: str = system) -> tuple[float, int]:
            body = {"model": "smol", "max_tokens": 2, "temperature": 0,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
            ttft, _, usage = ask(url, body, headers={"Authorization": f"Bearer {KEYS[key]}"})
            return ttft, int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))

        cold, _ = one("alpha", QUESTIONS[r % len(QUESTIONS)])
        probe, probe_cached = one("bravo", QUESTIONS[(r + 1) % len(QUESTIONS)])
        warm, warm_cached = one("alpha", QUESTIONS[(r + 2) % len(QUESTIONS)])
        for k, v in (("cold", cold), ("probe", probe), ("warm", warm), ("probe_cached", probe_cached),
                     ("warm_cached", warm_cached)):
            out[k].append(v)
        print(f"  round {r + 1}: cold {cold:.2f} s, bravo {probe:.2f} s ({probe_cached} cached), alpha warm "
              f"{warm:.2f} s ({warm_cached} cached)", flush=True)
    return out


def main(args: argparse.Namespace) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "CHORUS_BENCH_WORKER_KEY": "sk-bench-gateway"}
    rows = []
    for engine in args.engines:
        with ExitStack() as stack, tempfile.TemporaryDirectory() as tmpdir:
            tmp = Path(tmpdir)
            entry = model_entry(engine, args, stack, tmp, env)
            url = serve(stack, tmp, "serve", {"models": [entry], "server": {"prefix_cache": {"share": args.share}},
                                              "auth": {"keys": [{"name": k, "sha256": hash_key(v)}
                                                                for k, v in KEYS.items()]}}, env)
            print(f"chorus bench tenants: {args.model} on {engine}, share: {args.share}, {args.rounds} rounds",
                  flush=True)
            m = measure(url, args.rounds, args.system_tokens)
        rows.append([engine, f"{statistics.median(m['cold']):.2f}", f"{statistics.median(m['probe']):.2f}",
                     f"{statistics.median(m['warm']):.2f}", paired_ratio(m["probe"], m["cold"]),
                     paired_ratio(m["warm"], m["cold"]), str(int(max(m["probe_cached"]))),
                     str(int(statistics.median(m["warm_cached"]))), str(args.rounds)])
    print()
    print(f"share: {args.share}; system prompt about {args.system_tokens} tokens; TTFT in seconds (medians)")
    print("| engine | alpha cold | bravo, same prompt | alpha warm | bravo / cold | warm / cold | bravo cached "
          "tokens (max) | alpha warm cached tokens | n rounds |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="a config model with a GGUF source, prepared")
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    p.add_argument("--share", choices=("key", "team", "all"), default="key",
                   help="server.prefix_cache.share of the measured gateway (all: the side channel, for contrast)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--system-tokens", type=int, default=1500)
    p.add_argument("--threads", type=int, default=2)
