"""`chorus bench families-vllm`: each model family served by vLLM's CPU build beside chorus's transformers engine,
same checkpoint, one run.

Checkpoints freshly derived from the prepared SmolLM2 (`family_parity.derive_checkpoints`: their own parts
perturbed, so every branch, skill and expert does work): by default the Mixtral-layout MoE, the SOLAR-style
graft (natively on vLLM), MoDr and ReasonFormer (chorus's vLLM plugin, ``--enforce-eager
--no-enable-prefix-caching``). Per family, ``chorus serve`` (transformers engine, float32) and vLLM's OpenAI server
(float32) run at once and are measured in turn while the other is idle, rounds interleaved: ``k`` streamed
requests of ``--tokens`` tokens (``ignore_eos``, prompts of their own) for each k of ``--streams``; aggregate
tokens/s (median of ``--rounds`` rounds, with their range), TTFT p50 / p90 and the ratio to vLLM (`vllm.engine_rows`).
Everything shares this machine's cores: the figures are ratios within the run."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from chorus.bench.engine import Server, http_load, stop_servers
from chorus.bench.family_parity import CHECKPOINTS, derive_checkpoints
from chorus.bench.vllm import STREAMED, engine_rows
from chorus.clients.local import free_port, markdown_table, spawn, vllm_command, wait_ready

DEFAULT = ["moe-mixtral", "graft", "modr", "reasonformer-shared"]
#: what vLLM needs to serve chorus's plugin families (chorus/engines/families/on_vllm/over_base.py)
PLUGIN_FLAGS = ("--enforce-eager", "--no-enable-prefix-caching")


def servers_for(name: str, path: Path, args: argparse.Namespace, tmp: Path) -> list[Server]:
    """chorus serve (transformers engine) and vLLM (last: the peer of the ratios) on the checkpoint ``path``."""
    top = max(args.streams)
    port = free_port()
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(json.dumps({"server": {"limits": {"max_concurrent_requests": 1024}},
                               "models": [{"name": name, "path": str(path), "max_batch_size": top,
                                           "max_model_len": 2048}]}))
    ours = Server("chorus serve, transformers engine", [sys.executable, "-m", "chorus", "serve", "--config", str(cfg),
                                                        "--port", str(port), "--no-prepare", "--log-level", "warning"],
                  port, name, STREAMED, tmp / f"{name}-chorus.log")
    port = free_port()
    flags = PLUGIN_FLAGS if CHECKPOINTS[name][1] == "chorus's plugin" else ("--enforce-eager",)
    theirs = Server(f"vLLM 0.32.0 ({CHECKPOINTS[name][1]})",
                    vllm_command(args.vllm, path, name, port, "--max-num-seqs", str(top), *flags), port, name,
                    STREAMED, tmp / f"{name}-vllm.log")
    return [ours, theirs]


def main(args: argparse.Namespace) -> int:
    from chorus.config import load_config
    from chorus.engines.core.registry import prepare_model

    base = prepare_model(load_config(args.config).model(args.base), log=lambda m: None)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "VLLM_LOGGING_LEVEL": "WARNING",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    table: list[list[object]] = []
    with tempfile.TemporaryDirectory(prefix="chorus-bench-families-") as d:
        tmp = Path(d)
        dirs = derive_checkpoints(base, tmp / "checkpoints", args.families)
        for name, path in dirs.items():
            servers = servers_for(name, path, args, tmp)
            try:
                for srv in servers:
                    srv.proc = spawn(srv.cmd, stdout=open(srv.log, "w"), stderr=subprocess.STDOUT,
                                                env=env)
                for srv in servers:
                    try:
                        wait_ready(srv.url + "/v1/models", srv.proc, timeout=900)
                    except RuntimeError:
                        print(srv.log.read_text()[-3000:], file=sys.stderr)
                        raise
                for srv in servers:
                    http_load(srv.url, srv.model, 4, 1, srv.extra)  # warm-up
                table += [[CHECKPOINTS[name][0], *row] for row in engine_rows(servers, args)]
            finally:
                stop_servers(servers)
    print(f"chorus bench families-vllm: checkpoints derived from {args.base}, {os.cpu_count()} cores shared by both "
          f"servers and the clients; {args.tokens} tokens per streamed request, {args.rounds} rounds interleaved")
    print()
    print(markdown_table(["family", "server", "streams", "tokens/s (median)", "range", "vs vLLM", "TTFT p50 s",
                          "TTFT p90 s", "tokens"], table))
    if args.json:
        Path(args.json).write_text(json.dumps({"base": args.base, "tokens": args.tokens, "rounds": args.rounds,
                                               "streams": args.streams, "rows": table}, indent=1) + "\n")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", default="smollm2-135m-instruct", help="the config's model the checkpoints derive from")
    p.add_argument("--families", nargs="*", default=DEFAULT, choices=list(CHECKPOINTS))
    p.add_argument("--vllm", metavar="PYTHON", default=".venv-vllm/bin/python",
                   help="the Python of vLLM's CPU build (make vllm)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per streamed request")
    p.add_argument("--streams", type=int, nargs="*", default=[1, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", metavar="FILE", help="also write the table's rows here")
