"""`chorus bench gateway --feedback REDIS_URL`: the feedback path under load, two replicas on one Redis.

Two `chorus serve` processes (the bench's mock upstream behind each, the key's limits and the requests kept for
feedback in one Redis) are driven by two wrk processes at once, one per replica. Three configurations, in
interleaved rounds: *without* (no feedback metric declared, no feedback sent), *records kept* (a boolean metric
declared, so every answered request is kept for feedback, none sent) and *feedback on every request* (wrk's Lua
script also posts ``POST /v1/feedback`` for every chat completion it receives, with the ``X-Request-ID`` it got,
before its next chat request: half of its requests are feedback). Reported:
chat completions per second (the throughput a user gets), all requests per second, p50; then the books:
feedback sent (counted by the clients) against feedback accepted (the replicas' ``chorus_feedback_total``), and
the key's request window in Redis against the requests the clients made (both replicas count into it: the limits
stay exact only if that is equal).
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from chorus.clients.local import free_port, markdown_table, stop_all, wait_ready

ADMIN = "bench-admin"
MODES = ("without", "records kept, no feedback sent", "feedback on every request")

LUA = r"""
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer bench"
local chat = [[CHAT]]
local feedback = FEEDBACK
local threads = {}
function setup(thread) table.insert(threads, thread) end
ids, chats, sent, refused = {}, 0, 0, 0
request = function()
  local id = table.remove(ids)
  if feedback and id then
    sent = sent + 1
    return wrk.format("POST", "/v1/feedback", nil, '{"request_id":"' .. id .. '","metric":"ok","value":true}')
  end
  return wrk.format("POST", "/v1/chat/completions", nil, chat)
end
response = function(status, headers, body)
  if string.find(body, '"chat.completion"', 1, true) then
    chats = chats + 1
    local id = headers["x-request-id"]
    if id then table.insert(ids, id) end
  elseif status ~= 200 then
    refused = refused + 1
  end
end
done = function(summary, latency, requests)
  local c, s, r = 0, 0, 0
  for _, t in ipairs(threads) do c = c + t:get("chats"); s = s + t:get("sent"); r = r + t:get("refused") end
  io.write(string.format("BOOKS chats=%d feedback_sent=%d other_non200=%d requests=%d\n", c, s, r,
                         summary.requests))
end
"""


def lua(path: Path, feedback: bool) -> Path:
    chat = json.dumps({"model": "mock", "messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "max_tokens": 16})
    path.write_text(LUA.replace("CHAT", chat).replace("FEEDBACK", "true" if feedback else "false"))
    return path


def drive(urls: list[str], script: Path, connections: int, seconds: int) -> dict[str, float]:
    """One wrk (1 thread) per replica, at once; their books summed. wrk's own counters are per process."""
    procs = [subprocess.Popen(["wrk", "-t", "1", "-c", str(connections), "-d", f"{seconds}s", "--latency", "-s",
                               str(script), u + "/v1/chat/completions"], stdout=subprocess.PIPE, text=True)
             for u in urls]
    outs = [p.communicate(timeout=seconds + 60)[0] for p in procs]
    total: dict[str, float] = {"chats": 0, "feedback_sent": 0, "other_non200": 0, "requests": 0, "p50": 0.0}
    for out in outs:
        books = re.search(r"BOOKS (.*)", out)
        assert books, out
        for part in books.group(1).split():
            k, v = part.split("=")
            total[k] += float(v)
        m = re.search(r"50%\s+([\d.]+)(us|ms|s)\b", out)
        if m:
            v, unit = float(m.group(1)), m.group(2)
            total["p50"] += (v / 1000 if unit == "us" else v * 1000 if unit == "s" else v) / len(outs)
    return total


def metric(url: str, name: str, labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^{name}\{{{labels}\}} ([\d.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def window(url: str) -> int:
    r = httpx.get(url + "/admin/keys/bench", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    return int(r.json()["window"]["requests"])


def run(redis_url: str, tokenizer: str, seconds: int, rounds: int, connections: int) -> int:
    procs: list[subprocess.Popen[bytes]] = []
    up_port = free_port()
    rows, books = [], []
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        procs.append(subprocess.Popen([sys.executable, "-c", f"from chorus.clients.bench_gateway import "
                                       f"mock_upstream; mock_upstream({up_port})"]))
        upstream = f"http://127.0.0.1:{up_port}"
        wait_ready(upstream + "/v1/models", procs[-1])
        try:
            results: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
            for r in range(rounds):
                for mode in MODES:
                    prefix = f"benchfb-{MODES.index(mode)}-{r}-{time.time_ns()}"  # its own keys: a fresh window, nothing shared
                    urls = replicas(tmp, mode, redis_url, upstream, tokenizer, procs, prefix)
                    got = drive(urls, lua(tmp / f"mode{MODES.index(mode)}.lua", mode == MODES[2]), connections, seconds)
                    time.sleep(1.5)  # the replicas' record buffers drain
                    accepted = sum(metric(u, "chorus_feedback_total", 'metric="ok",outcome="accepted"') for u in urls)
                    got.update({"accepted": accepted, "window": window(urls[0]), "window_b": window(urls[1])})
                    results[mode].append(got)
                    stop_all(procs[1:])
                    del procs[1:]
                    print(f"round {r + 1} {mode}: {json.dumps(got)}", file=sys.stderr, flush=True)
        finally:
            stop_all(procs)
    base = None
    for mode, runs in results.items():
        best = max(runs, key=lambda x: x["chats"])
        base = base or best
        rows.append([mode, f"{best['chats'] / seconds:.0f}", f"{best['requests'] / seconds:.0f}",
                     f"{best['p50']:.2f}", f"{100 * (best['chats'] / base['chats'] - 1):+.1f}%"])
        for g in runs:
            books.append([mode, int(g["chats"]), int(g["feedback_sent"]), int(g["accepted"]), int(g["requests"]),
                          f"{int(g['window'])} / {int(g['window_b'])}", int(g["other_non200"])])
    print(f"chorus bench gateway --feedback: two replicas on one Redis, one wrk each ({connections} connections, "
          f"{seconds} s), best of {rounds} interleaved rounds per row")
    print(markdown_table(["feedback", "chat completions/s", "all requests/s", "p50 ms", "chat/s vs without"], rows))
    print()
    print(markdown_table(["feedback", "chats answered", "feedback sent", "feedback accepted", "requests made",
                          "key's window in Redis (as seen by each replica)", "other non-200"], books))
    return 0


def replicas(tmp: Path, mode: str, redis_url: str, upstream: str, tokenizer: str,
             procs: list[subprocess.Popen[Any]], prefix: str) -> list[str]:
    cfg = tmp / f"mode{MODES.index(mode)}.yaml"
    server: dict[str, Any] = {"limits": {"max_concurrent_requests": 4096}, "log": {"level": "warning"},
                              "state": {"store": redis_url, "key_prefix": prefix,
                                        "admin_sha256": hashlib.sha256(ADMIN.encode()).hexdigest()}}
    if mode != MODES[0]:
        server["feedback"] = {"metrics": [{"name": "ok", "type": "boolean"}]}
    cfg.write_text(json.dumps({
        "server": server,
        "auth": {"keys": [{"name": "bench", "sha256": hashlib.sha256(b"bench").hexdigest(), "rpm": 10**9,
                           "tpm": 10**12}]},
        "models": [{"name": "mock", "engine": "remote", "max_model_len": 4096,
                    "remote": {"replicas": [upstream + "/v1"], "tokenizer": tokenizer, "api": "chat"}}]}))
    urls = []
    for _ in range(2):
        port = free_port()
        procs.append(subprocess.Popen([sys.executable, "-m", "chorus", "serve", "--config", str(cfg), "--port",
                                       str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        urls.append(f"http://127.0.0.1:{port}")
        wait_ready(urls[-1] + "/health", procs[-1])
    return urls
