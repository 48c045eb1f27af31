"""`chorus bench gateway`: what the gateway adds in front of a fast upstream, measured with wrk.

``--upstream URL`` puts it in front of a real server instead (vLLM, ``--upstream-model`` its model's name), the
gateway sending the prompt as token ids as it does to vLLM in production (``api: completions``).

A mock OpenAI upstream (a raw asyncio server: fixed chat completion, or a fixed SSE stream) runs on
127.0.0.1; wrk (Debian's, with a Lua body script) drives it directly, through one `chorus serve`
process (an ``engine: remote`` model pointing at the mock), and through the LiteLLM proxy when its
``litellm`` command is given (``--litellm``) or on PATH. LiteLLM is not a chorus dependency: install it in a
venv of its own (``python -m venv /tmp/litellm && /tmp/litellm/bin/pip install 'litellm[proxy]'``: 1.108.7 on
2026-12-07; earlier releases' proxy extra did not resolve here) and pass ``--litellm /tmp/litellm/bin/litellm``.
With ``--redis URL`` a second chorus process counts the same key's limits (rpm and tpm set, never reached) in
Redis instead of in memory: the difference between the two chorus rows is the shared limiter's cost per request
(one admission script, one release, one charge script). Requests/s and latency percentiles at concurrency 1 and
32, non-streaming and streaming; each cell the median of ``--rounds`` interleaved rounds with their range (the
added latency paired round by round with the direct path); one table, one run, ``--json`` for the data file.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from chorus.clients.local import free_port, markdown_table, stop_all, wait_ready

COMPLETION = json.dumps({
    "id": "cmpl-mock", "object": "chat.completion", "created": 0, "model": "mock",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris is the capital of France."},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20}}).encode()
WORDS = ["Paris", " is", " the", " capital", " of", " France", "."]


def sse_body() -> bytes:
    out = []
    for w in WORDS:
        out.append({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "mock",
                    "choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]})
    out.append({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "mock",
                "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in out) + b"data: [DONE]\n\n"


SSE = sse_body()


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            body = await reader.readexactly(length) if length else b""
            if head.startswith(b"GET"):
                payload, ctype = b'{"status":"ok","data":[{"id":"mock","object":"model"}]}', b"application/json"
            elif b'"stream":true' in body.replace(b" ", b""):
                payload, ctype = SSE, b"text/event-stream"
            else:
                payload, ctype = COMPLETION, b"application/json"
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: " + ctype + b"\r\nContent-Length: "
                         + str(len(payload)).encode() + b"\r\n\r\n" + payload)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


def mock_upstream(port: int) -> None:
    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


LITELLM_KEY = "sk-bench-0123456789abcdef0123456789abcdef"


def wrk(url: str, body: dict[str, object], connections: int, seconds: int, tmp: Path, key: str,
        timeout_s: int = 2) -> dict[str, float]:
    """One wrk run; a request slower than ``timeout_s`` counts as a socket error, not in the latencies."""
    script = tmp / "post.lua"
    script.write_text('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                      f'wrk.headers["Authorization"] = "Bearer {key}"\nwrk.body = [[{json.dumps(body)}]]\n')
    out = subprocess.run(["wrk", "-t", "1", "-c", str(connections), "-d", f"{seconds}s", "--latency", "--timeout",
                          f"{timeout_s}s", "-s", str(script), url], capture_output=True, text=True,
                         timeout=seconds + timeout_s + 60).stdout

    def ms(label: str) -> float:
        m = re.search(rf"{label}\s+([\d.]+)(us|ms|s)\b", out)
        if not m:
            return float("nan")
        v, unit = float(m.group(1)), m.group(2)
        return v / 1000 if unit == "us" else v * 1000 if unit == "s" else v

    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    return {"rps": float(rps.group(1)) if rps else 0.0, "p50": ms("50%"), "p99": ms("99%"),
            "non2xx": float(non2xx.group(1)) if non2xx else 0.0, "errors": 1.0 if errors else 0.0}


def main(args: argparse.Namespace) -> int:
    if shutil.which("wrk") is None:
        sys.exit("chorus bench gateway: needs wrk (apt-get install wrk)")
    if args.feedback:
        from chorus.clients import bench_feedback

        return bench_feedback.run(args.feedback, args.tokenizer, args.seconds, args.rounds, args.connections)
    tok = args.tokenizer
    up_port, gw_port = free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        env = dict(os.environ)
        if args.upstream:  # a real server (vLLM): the gateway sends it the prompt as token ids (api: completions)
            upstream, name, api = args.upstream.removesuffix("/v1").rstrip("/"), args.upstream_model, "completions"
            wait_ready(upstream + "/v1/models")
            targets = {f"direct to {name} ({upstream})": upstream}
        else:
            procs.append(subprocess.Popen([sys.executable, "-c", "from chorus.clients.bench_gateway import "
                                           f"mock_upstream; mock_upstream({up_port})"], env=env))
            upstream, name, api = f"http://127.0.0.1:{up_port}", "mock", "chat"
            wait_ready(upstream + "/v1/models", procs[-1])
            targets = {"direct to the mock upstream": upstream}
        stores = {"through chorus (1 process)": ("memory", 1, None)}
        if args.against:  # another checkout's gateway beside this one's, in the same rounds (before / after a change)
            stores[f"through chorus at {args.against}"] = ("memory", 1, args.against)
        if args.redis:
            stores["through chorus, limits in Redis"] = (args.redis, 1, None)
            if args.processes > 1:
                stores[f"through chorus ({args.processes} processes, limits in Redis)"] = (args.redis, args.processes,
                                                                                            None)
        for label, (store, processes, checkout) in stores.items():  # the same key and limits; counted elsewhere
            port = gw_port if store == "memory" and checkout is None else free_port()
            cfg = tmp / f"gw-{port}.yaml"
            cfg.write_text(json.dumps({
                "server": {"limits": {"max_concurrent_requests": 4096}, "log": {"level": args.log_level},
                           "state": {"store": store, "key_prefix": f"bench{port}"}},
                "auth": {"keys": [{"name": "bench", "sha256": hashlib.sha256(b"bench").hexdigest(),
                                   "rpm": 10**9, "tpm": 10**12}]},
                "models": [{"name": "mock", "engine": "remote", "max_model_len": 4096,
                            "remote": {"replicas": [upstream + "/v1"], "tokenizer": tok, "api": api,
                                       "model": name}}]}))
            procs.append(subprocess.Popen([sys.executable, "-m", "chorus", "serve", "--config", str(cfg), "--port",
                                           str(port), "--workers", str(processes)], env=env, cwd=checkout,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            targets[label] = f"http://127.0.0.1:{port}"
            wait_ready(targets[label] + "/health", procs[-1])
        exe = args.litellm or shutil.which("litellm")
        if exe:
            lport = free_port()
            lcfg = tmp / "litellm.yaml"
            lcfg.write_text(json.dumps({"model_list": [{"model_name": "mock", "litellm_params": {
                "model": "openai/mock", "api_base": upstream + "/v1", "api_key": "x"}}]}))
            lenv = {**env, "LITELLM_MASTER_KEY": LITELLM_KEY, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
            procs.append(subprocess.Popen([exe, "--config", str(lcfg), "--port", str(lport), "--num_workers", "1"],
                                          env=lenv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            try:
                wait_ready(f"http://127.0.0.1:{lport}/health/liveliness", procs[-1], timeout=240)
                targets["through LiteLLM proxy"] = f"http://127.0.0.1:{lport}"
            except RuntimeError as exc:
                print(f"LiteLLM proxy not measured: {exc}", file=sys.stderr)
        try:
            rows: list[list[str]] = []
            measured: list[dict[str, object]] = []
            paired: list[list[str]] = []
            for stream in (False, True):
                body = {"model": "mock", "messages": [{"role": "user", "content": "What is the capital of France?"}],
                        "max_tokens": 16, "stream": stream}
                for c in args.concurrency:
                    runs: dict[str, list[dict[str, float]]] = {label: [] for label in targets}
                    for r in range(args.rounds):  # rounds interleave the targets (every other round in reverse
                        # order): drift in load hits them alike
                        for label, url in (reversed(targets.items()) if r % 2 else targets.items()):
                            key = LITELLM_KEY if "LiteLLM" in label else "bench"
                            sent = {**body, "model": name} if label.startswith("direct") else body
                            runs[label].append(wrk(url + "/v1/chat/completions", sent, c, args.seconds, tmp, key,
                                                   timeout_s=120 if args.upstream else 2))
                    direct = runs[next(iter(runs))]  # the first target: the path without a gateway
                    if args.against:
                        paired.append(against_row(stream, c, runs, args.against))
                    for label, results in runs.items():
                        added = [r["p50"] - d["p50"] for r, d in zip(results, direct)]  # paired by round
                        cells = {"rps": spread([r["rps"] for r in results]), "p50": spread([r["p50"] for r in results]),
                                 "p99": spread([r["p99"] for r in results]), "added_p50": spread(added)}
                        measured.append({"mode": "stream" if stream else "non-stream", "concurrency": c,
                                         "path": label, **cells,
                                         "non2xx": int(sum(x["non2xx"] for x in results))})
                        rows.append([("stream" if stream else "non-stream"), str(c), label,
                                     shown(cells["rps"], "{:.0f}"), shown(cells["p50"], "{:.2f}"),
                                     shown(cells["p99"], "{:.2f}"), shown(cells["added_p50"], "{:+.2f}"),
                                     str(measured[-1]["non2xx"])])
        finally:
            stop_all(procs)
    header = ["mode", "conc.", "path", "req/s", "p50 ms", "p99 ms", "added p50 ms", "non-2xx"]
    where = f"upstream {args.upstream} ({args.upstream_model})" if args.upstream else "mock upstream on 127.0.0.1"
    source = (f"chorus bench gateway: wrk, 1 thread, {args.seconds} s per run, {args.rounds} interleaved rounds per "
              f"cell, each figure their median [lowest, highest]; added p50 paired with the direct path's same round; "
              f"{where}")
    print(source)
    print(markdown_table(header, rows))
    if paired:
        print(f"\nthis checkout against {args.against}, paired by round (> 1: this checkout has more req/s, a lower "
              "p50); each the median of the rounds' ratios [lowest, highest], and the rounds where this one was ahead")
        print(markdown_table(["mode", "conc.", "req/s ratio", "p50 ratio (theirs / ours)", "ahead in"], paired))
    if args.json:
        Path(args.json).write_text(json.dumps({"source": source, "rounds": args.rounds, "rows": measured},
                                              indent=1) + "\n")
    return 0


def against_row(stream: bool, c: int, runs: dict[str, list[dict[str, float]]], against: str) -> list[str]:
    """This checkout's gateway against the other's, round by round (both measured in every round, in turn)."""
    ours, theirs = runs["through chorus (1 process)"], runs[f"through chorus at {against}"]
    rps = [o["rps"] / t["rps"] for o, t in zip(ours, theirs) if t["rps"]]
    p50 = [t["p50"] / o["p50"] for o, t in zip(ours, theirs) if o["p50"]]
    ahead = sum(o["rps"] > t["rps"] for o, t in zip(ours, theirs))
    return ["stream" if stream else "non-stream", str(c), shown(spread(rps), "{:.3f}"), shown(spread(p50), "{:.3f}"),
            f"{ahead}/{len(ours)}"]


def spread(values: list[float]) -> dict[str, float]:
    """The rounds' median and their range (the interval a few interleaved rounds can give)."""
    import statistics

    return {"median": statistics.median(values), "low": min(values), "high": max(values)}


def shown(cell: dict[str, float], fmt: str) -> str:
    return f"{fmt.format(cell['median'])} [{fmt.format(cell['low'])}, {fmt.format(cell['high'])}]"


def default_tokenizer() -> str:
    """The prepared SmolLM2 (``chorus models prepare``): the mock model's tokenizer."""
    home = Path(os.environ.get("CHORUS_HOME") or Path.home() / ".cache" / "chorus")
    return str(home / "models" / "smollm2-135m-instruct")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", default=default_tokenizer(),
                   help="tokenizer directory for the gateway's mock model (default: the prepared SmolLM2)")
    p.add_argument("--seconds", type=int, default=10)
    p.add_argument("--upstream", help="a running OpenAI server to put the gateway in front of (e.g. vLLM's "
                   "http://127.0.0.1:8000/v1) instead of the mock; --tokenizer must be its model's")
    p.add_argument("--upstream-model", default="smol", help="--upstream: the model's name there")
    p.add_argument("--rounds", type=int, default=5,
                   help="runs per cell, interleaved; each figure is their median with their range")
    p.add_argument("--json", help="also write the rows (medians and ranges) to this file (docs/data/gateway.json)")
    p.add_argument("--log-level", default="info", help="the gateway's log level (info: one access line per request)")
    p.add_argument("--litellm", help="the LiteLLM proxy's `litellm` command (default: on PATH; not measured if absent)")
    p.add_argument("--feedback", metavar="REDIS_URL",
                   help="measure the feedback path instead: two replicas on this Redis, with and without feedback "
                        "on every request (clients/bench_feedback.py)")
    p.add_argument("--connections", type=int, default=16, help="--feedback: wrk connections per replica")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32], help="wrk connections per cell")
    p.add_argument("--processes", type=int, default=1,
                   help="with --redis: one more row, the gateway as this many processes (chorus serve --workers)")
    p.add_argument("--against", metavar="CHECKOUT",
                   help="another checkout of chorus (e.g. `git worktree add /tmp/before REV`): its gateway is measured "
                        "beside this one's in every round, in turn, and the two compared round by round")
    p.add_argument("--redis", help="a Redis URL: one more chorus process counting the same key's limits there "
                   "(server.state.store), for the shared limiter's cost per request")
