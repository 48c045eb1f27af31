"""`chorus bench llama`: chorus's llama.cpp engine against the servers a CPU user would pick, in one table.

One run, one GGUF, one prompt, greedy, ``--tokens`` tokens per request. Rounds alternate between the servers
(all up at once, each round in another order; each measurement starts once the machine is idle,
`engine.settle`); each cell gives the best and the median of ``--rounds`` rounds and the ratio to the peer round
by round (geometric mean, 95% interval). Streaming SSE clients, 1 / 4 / 8 / 16 at once (``--streams``):
aggregate tokens/s and time to first token. Every request opens with a system message of its own: llama-server
and llama_cpp.server keep a repeated prompt's KV cells and skip its prefill (as chorus's prefix cache now does), which with one
fixed prompt made their TTFT 0.03 s against chorus's 0.13 s before chorus cached prompts (a 42-token prefill of this model takes about 100 ms on 2 cores in all three).

Servers:
- ``chorus serve``, ``engine: llama_cpp`` (this engine);
- ``chorus serve``, ``engine: transformers`` on the same model (the dequantized float32 checkpoint);
- ``llama_cpp.server`` (llama-cpp-python's own OpenAI server, same library build), when its extra deps are there;
- ``llama-server --parallel N`` (llama.cpp's server, continuous batching), when ``--llama-server PATH`` is given
  (build it from the llama.cpp sources that llama-cpp-python vendors: docs/benchmarks.md says how).

Then, at one stream: a two-member ``logit_average`` of llama.cpp members against one member alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from chorus.bench.engine import Result, Server, http_load, stop_servers
from chorus.clients.local import free_port, wait_ready

STREAMS = (1, 4, 8, 16)


def _servers(args: argparse.Namespace, gguf: Path, tmp: Path, llama_model: dict, tf_model: dict | None
             ) -> list[Server]:
    configs = {  # each server its own config: the llama.cpp one serves llama.cpp models only (as a user would)
        "llama_cpp": {"models": [llama_model], "ensembles": [{"name": "llama-avg", "strategy": "logit_average",
                                                              "members": [llama_model["name"]] * 2}]},
        **({"transformers": {"models": [tf_model]}} if tf_model else {})}
    same = {"ignore_eos": True, "stream_options": {"include_usage": True}}
    out = []
    for engine, config in configs.items():
        cfg = tmp / f"{engine}.yaml"
        cfg.write_text(json.dumps(config))
        model = config["models"][0]["name"]
        port = free_port()
        out.append(Server(f"chorus serve, engine: {engine}", [
            sys.executable, "-m", "chorus", "serve", "--config", str(cfg), "--port", str(port), "--no-prepare",
            "--log-level", "warning"], port, model, same, tmp / f"{model}.log"))
    if importlib.util.find_spec("sse_starlette") and importlib.util.find_spec("starlette_context"):
        port = free_port()
        out.append(Server("llama_cpp.server (llama-cpp-python)", [
            sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--n_threads", str(args.threads),
            "--n_ctx", "4096", "--interrupt_requests", "False", "--port", str(port)], port, str(gguf),
            {"stream_options": {"include_usage": True}},
            tmp / "lcp.log"))
    else:
        print("llama_cpp.server: skipped (needs llama-cpp-python[server]: starlette-context)", file=sys.stderr)
    if args.llama_server:
        port = free_port()
        out.append(Server(f"llama-server --parallel {max(args.streams)}", [
            args.llama_server, "-m", str(gguf), "-t", str(args.threads), "--parallel", str(max(args.streams)),
            "-c", str(2048 * max(args.streams)), "--port", str(port), "--cont-batching"], port, "model",
            {"ignore_eos": True}, tmp / "llama-server.log"))
    return out


def main(args: argparse.Namespace) -> int:
    from chorus.config import load_config
    from chorus.engines.core.registry import is_ready
    from chorus.engines.core.sources import resolve_gguf
    from chorus.engines.core.spec import chorus_home

    config = load_config(args.config)
    base = config.model(args.model)
    gguf = resolve_gguf(base, chorus_home())
    # the transformers peer: the same entry when it is a transformers model whose float32 checkpoint is prepared
    tf_model = (base.model_dump(exclude_none=True) if args.transformers and base.engine == "transformers"
                and is_ready(base) else None)
    if tf_model is None:
        print(f"chorus serve, engine: transformers: skipped ({args.model} is not a prepared transformers model, or "
              "--no-transformers)", file=sys.stderr)
    # max_batch_size: at least the two sequences of the two-member ensemble (with one, it waited for itself)
    name = base.name if base.engine == "llama_cpp" else f"{base.name}-llama"
    llama_model = {"name": name, "engine": "llama_cpp",
                   **({"source": base.sources} if base.source else {"path": str(gguf)}),
                   **({"gguf": base.gguf.model_dump()} if base.gguf else {}),
                   "max_batch_size": max(*args.streams, 2), "max_model_len": 2048, "llama_cpp": {"threads": args.threads}}
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    print(f"chorus bench llama: {gguf.name}, {args.threads} threads, {args.tokens} tokens per request, greedy, "
          f"best and median of {args.rounds} rounds", flush=True)
    results: dict[tuple[str, int], list[Result]] = {}
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        servers = _servers(args, gguf, tmp, llama_model, tf_model)
        ready: list[Server] = []
        try:
            for srv in servers:
                srv.proc = subprocess.Popen(srv.cmd, stdout=open(srv.log, "w"), stderr=subprocess.STDOUT, env=env)
            for srv in servers:
                try:
                    wait_ready(srv.url + "/v1/models", srv.proc, timeout=600)
                    http_load(srv.url, srv.model, 4, 1, srv.extra)
                    ready.append(srv)
                except Exception as exc:
                    print(f"{srv.label} failed: {exc}\n{srv.log.read_text()[-1500:]}", file=sys.stderr)
            chorus = ready[0] if ready and ready[0].label.endswith("llama_cpp") else None
            for rnd in range(args.rounds):
                for k in args.streams:
                    for srv in ready[rnd % len(ready):] + ready[:rnd % len(ready)]:  # each round another order
                        results.setdefault((srv.label, k), []).append(
                            http_load(srv.url, srv.model, args.tokens, k, srv.extra, unique=True))
                if chorus is not None:
                    r = http_load(chorus.url, "llama-avg", args.tokens, 1, chorus.extra, unique=True)
                    # an ensemble's usage counts every member's tokens; the rate that compares is the answer's
                    answer = args.tokens
                    results.setdefault(("logit_average of two llama.cpp members", 1), []).append(
                        Result(r.tok_s * answer / r.tokens, r.ttfts, answer))
        finally:
            stop_servers(servers)
    best = {key: max(v, key=lambda r: r.tok_s) for key, v in results.items()}
    median = {key: statistics.median(r.tok_s for r in v) for key, v in results.items()}
    peer = next((s.label for s in ready if s.label.startswith("llama-server")),
                next((s.label for s in ready if s.label.startswith("llama_cpp.server")), None))
    print()
    print(f"| server | streams | tokens/s best | median | vs {peer or '-'}: best | paired rounds: geometric mean "
          f"[95% CI], n={args.rounds} | TTFT p50 (s) | TTFT max (s) | tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (label, k), r in best.items():
        ref = (peer, k) if peer and (peer, k) in best else None
        if label.startswith("logit_average"):
            ref = (ready[0].label, 1) if (ready[0].label, 1) in best else None
        ratio = paired = "-"
        if ref is not None:
            vs = " vs one member" if label.startswith("logit_average") else ""
            ratio = f"{r.tok_s / best[ref].tok_s:.2f}x{vs}"
            paired = paired_ratio([x.tok_s for x in results[label, k]], [x.tok_s for x in results[ref]])
        t = r.ttfts
        print(f"| {label} | {k} | {r.tok_s:.1f} | {median[label, k]:.1f} | {ratio} | {paired} "
              f"| {statistics.median(t):.2f} | {max(t):.2f} | {r.tokens} |")
    return 0


def paired_ratio(a: list[float], b: list[float]) -> str:
    """Round by round ``a / b`` (each round measures both within a minute, so the machine's slow drifts cancel):
    the geometric mean and a t interval on the log ratios."""
    import numpy as np
    from scipy import stats

    logs = np.log(np.array(a) / np.array(b))
    if len(logs) < 2:
        return f"{np.exp(logs.mean()):.2f}x"
    half = float(stats.t.ppf(0.975, len(logs) - 1) * logs.std(ddof=1) / np.sqrt(len(logs)))
    m = float(logs.mean())
    return f"{np.exp(m):.2f}x [{np.exp(m - half):.2f}, {np.exp(m + half):.2f}]"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="any config model whose source is a GGUF (a transformers entry, or an engine: llama_cpp one)")
    p.add_argument("--transformers", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure the transformers engine on the dequantized checkpoint (where it is prepared)")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, nargs="+", default=list(STREAMS))
    p.add_argument("--llama-server", metavar="PATH", help="llama.cpp's llama-server binary (the peer to beat)")
