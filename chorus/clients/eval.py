"""`chorus eval`: accuracy of models and ensembles on your own data, side by side, through the HTTP API.

Data: JSONL, one object per line with ``question`` and (optionally) ``answer``; a GSM8K-style answer
("... #### 72") is reduced to what follows ``####``. A ``route`` field names the member that should
answer (for routing strategies: the table then shows how often the router chose it). Multiple-choice
data (``choices`` and ``label``) is scored through ``/v1/choices`` instead (``eval_choices.py``). Each system
(``--model NAME`` or ``--ensemble JSON``, any number of each) answers every question through
``/v1/chat/completions``; the answer is extracted from the reply
the way Exchange-of-Thought does ("the answer is X"; ``--answer choice`` for option letters), and the
table shows accuracy, tokens, member calls and latency per system. Without ``--url`` a ``chorus serve``
is started for the run (``--config`` picks its config) and stopped afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from chorus.clients import eval_choices
from chorus.clients.local import free_port, markdown_table, wait_ready
from chorus.ensembles.answers.extract import extract_answer

INSTRUCTION = 'Solve the problem step by step, and end with "The answer is X".'


@dataclass
class System:
    label: str
    model: str
    ensemble: dict[str, Any] | None = None


@dataclass
class Tally:
    correct: int = 0
    done: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    calls: int = 0
    latencies: list[float] = field(default_factory=list)
    graded: int = 0
    routed: int = 0
    routed_right: int = 0
    answered_by: dict[str, int] = field(default_factory=dict)


def gold_answer(answer: Any, kind: str) -> str:
    text = str(answer)
    if "####" in text:
        text = "The answer is " + text.split("####")[-1]
    elif not text.lower().startswith("the answer is"):
        text = "The answer is " + text
    return extract_answer(text, kind)


def load_data(path: Path, limit: int | None) -> list[tuple[str, Any, Any]]:
    rows = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                rows.append((item["question"], item.get("answer"), item))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
                raise SystemExit(
                    f"chorus eval: {path}:{n}: need a JSON object with 'question' (and 'answer') ({exc})"
                ) from None
            if limit is not None and len(rows) >= limit:
                break
    return rows


def systems_from(args: argparse.Namespace) -> list[System]:
    out = [System(m, m) for m in args.model or []]
    for i, raw in enumerate(args.ensemble or []):
        try:
            spec = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"chorus eval: --ensemble is not JSON: {exc}") from None
        label = spec.pop("label", None) or f"{spec.get('strategy', 'ensemble')}#{i + 1}"
        members = spec.get("members") or [{"model": "ensemble"}]
        first = members[0] if isinstance(members[0], str) else members[0].get("model", "ensemble")
        out.append(System(label, first, {**spec, "trace": True}))
    if not out:
        raise SystemExit("chorus eval: give at least one --model or --ensemble")
    return out


def request_body(system: System, question: str, args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"model": system.model, "temperature": args.temperature, "max_tokens": args.max_tokens,
                            "messages": [{"role": "user", "content": f"{question}\n\n{args.instruction}"}]}
    if system.ensemble is not None:
        body["ensemble"] = system.ensemble
    return body


async def ask(http: httpx.AsyncClient, system: System, question: str, args: argparse.Namespace) -> dict[str, Any]:
    r = await http.post("/chat/completions", json=request_body(system, question, args))
    if r.status_code != 200:
        raise RuntimeError(f"{r.status_code}: {r.text[:300]}")
    return r.json()


async def run_system(http: httpx.AsyncClient, system: System, data: list[tuple[str, Any, Any]],
                     args: argparse.Namespace) -> Tally:
    tally = Tally()
    gate = asyncio.Semaphore(args.concurrency)

    async def one(question: str, answer: Any, item: dict[str, Any]) -> None:
        async with gate:
            t0 = time.perf_counter()
            try:
                resp = await ask(http, system, question, args)
            except (httpx.HTTPError, RuntimeError) as exc:
                tally.failed += 1
                print(f"  {system.label}: failed: {exc}", file=sys.stderr)
                return
            tally.latencies.append(time.perf_counter() - t0)
        record(tally, system, resp, answer, item, args)

    await asyncio.gather(*(one(q, a, item) for q, a, item in data))
    return tally


def record(tally: Tally, system: System, resp: dict[str, Any], answer: Any, item: dict[str, Any],
           args: argparse.Namespace) -> None:
    """Count one answered question: tokens, calls, who answered, and whether the answer is right."""
    tally.done += 1
    usage = resp.get("usage") or {}
    tally.prompt_tokens += usage.get("prompt_tokens", 0)
    tally.completion_tokens += usage.get("completion_tokens", 0)
    trace = resp.get("ensemble")
    tally.calls += trace["usage"]["calls"] if trace else 1
    chosen = ((trace or {}).get("winner") or {}).get("member") or system.model
    tally.answered_by[chosen] = tally.answered_by.get(chosen, 0) + 1
    if item.get("route") is not None:
        tally.routed += 1
        tally.routed_right += chosen == item["route"]
    if answer is not None:
        tally.graded += 1
        got = extract_answer(resp["choices"][0]["message"]["content"] or "", args.answer)
        tally.correct += got != "" and got == gold_answer(answer, args.answer)


def run_batch(url: str, systems: list[System], data: list[tuple[str, Any, Any]],
              args: argparse.Namespace) -> list[Tally]:
    """Every system's questions as one batch (the server's Batch API, through `chorus batch`'s steps): uploaded,
    followed until it ends, its output and error files read back into the same tallies."""
    import openai

    from chorus.clients import batch as batches

    lines = [json.dumps({"custom_id": f"{si}:{qi}", "method": "POST", "url": "/v1/chat/completions",
                         "body": request_body(s, q, args)})
             for si, s in enumerate(systems) for qi, (q, _, _) in enumerate(data)]
    client = openai.OpenAI(base_url=url, api_key=args.api_key, timeout=args.timeout)
    made = batches.create(client, ("eval.jsonl", ("\n".join(lines) + "\n").encode()), "/v1/chat/completions",
                          metadata={"by": "chorus eval"})
    done = batches.follow(client, made.id)
    for reason in (done.errors.data if done.errors else []):
        raise SystemExit(f"chorus eval: the batch failed: {reason.message}")
    tallies = [Tally() for _ in systems]
    for row in batches.rows(client, done):
        si, qi = map(int, row["custom_id"].split(":"))
        response = row.get("response") or {}
        if response.get("status_code") == 200:
            _, answer, item = data[qi]
            record(tallies[si], systems[si], response["body"], answer, item, args)
        else:
            tallies[si].failed += 1
            why = (response.get("body") or {}).get("error") or row.get("error") or {}
            print(f"  {systems[si].label}: failed: {why.get('message')}", file=sys.stderr)
    return tallies


def report(systems: list[System], tallies: list[Tally], n: int) -> str:
    header = ["system", "accuracy", "answered", "completion tok/q", "total tok", "calls/q", "p50 s", "mean s",
              "route choice", "answered by"]
    rows = []
    for s, t in zip(systems, tallies):
        lat = t.latencies or [float("nan")]
        acc = f"{t.correct / t.graded:.3f} ({t.correct}/{t.graded})" if t.graded else "-"
        route = f"{t.routed_right / t.routed:.3f} ({t.routed_right}/{t.routed})" if t.routed else "-"
        by = ", ".join(f"{k} {v}" for k, v in sorted(t.answered_by.items(), key=lambda kv: -kv[1]))
        rows.append([s.label, acc, f"{t.done}/{n}",
                     f"{t.completion_tokens / max(t.done, 1):.0f}", str(t.prompt_tokens + t.completion_tokens),
                     f"{t.calls / max(t.done, 1):.1f}", f"{statistics.median(lat):.1f}", f"{statistics.fmean(lat):.1f}",
                     route, by])
    return markdown_table(header, rows)


def start_server(config: str | None) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "chorus", "serve", "--port", str(port), "--log-level", "warning"]
    if config:
        cmd += ["--config", config]
    proc = subprocess.Popen(cmd, env=os.environ.copy(), stdout=sys.stderr)  # stdout is for the table
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url + "/health", proc, timeout=600, interval=1.0)
    except RuntimeError as exc:
        proc.terminate()
        raise SystemExit(f"chorus eval: {exc}") from None
    return proc, url + "/v1"


@contextlib.contextmanager
def serving(args: argparse.Namespace) -> Iterator[str]:
    """The /v1 URL to evaluate against: ``--url``, or a ``chorus serve`` (``--config``) started for the run
    and stopped afterwards."""
    if args.url:
        yield args.url
        return
    proc, url = start_server(args.config)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def _run(args: argparse.Namespace) -> str:
    if eval_choices.is_multiple_choice(Path(args.data)):
        with serving(args) as url:
            return await eval_choices.evaluate(args, url, {"Authorization": f"Bearer {args.api_key}"})
    data = load_data(Path(args.data), args.limit)
    if not data:
        raise SystemExit(f"chorus eval: no questions in {args.data}")
    systems = systems_from(args)
    with serving(args) as url:
        async with httpx.AsyncClient(base_url=url, timeout=args.timeout,
                                     headers={"Authorization": f"Bearer {args.api_key}"}) as http:
            cards = (await http.get("/models")).json().get("data", [])
            named = {c["id"] for c in cards if c.get("ensemble")}
            for s in systems:
                if s.ensemble is None and s.model in named:
                    s.ensemble = {"trace": True}  # a named ensemble: its trace tells the member calls
            t0 = time.perf_counter()
            if args.batch:
                print(f"{len(systems)} systems x {len(data)} questions as one batch ...", file=sys.stderr, flush=True)
                tallies = await asyncio.to_thread(run_batch, url, systems, data, args)
            else:
                tallies = []
                for s in systems:
                    print(f"{s.label}: {len(data)} questions ...", file=sys.stderr, flush=True)
                    tallies.append(await run_system(http, s, data, args))
    how = f"one batch, {time.perf_counter() - t0:.0f} s in all" if args.batch else "live requests"
    return (f"{len(data)} questions from {args.data}; temperature {args.temperature}, max_tokens {args.max_tokens}; "
            f"{how}\n" + report(systems, tallies, len(data)))


def main(args: argparse.Namespace) -> int:
    print(asyncio.run(_run(args)))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="JSONL with 'question' and 'answer' per line (GSM8K works as is), "
                   "or multiple choice: 'choices' and 'label' (PIQA, ARC, HellaSwag as in the shared data)")
    p.add_argument("--model", action="append", help="a served model or named ensemble (repeatable)")
    p.add_argument("--ensemble", action="append", help='an ensemble as JSON, e.g. \'{"strategy": "crowd_vote", '
                                                      '"members": ["a", "b"], "label": "vote"}\' (repeatable)')
    p.add_argument("--limit", type=int, help="first N questions")
    p.add_argument("--answer", choices=["number", "choice"], default="number")
    p.add_argument("--instruction", default=INSTRUCTION, help="appended to every question")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=4, help="questions in flight per system")
    p.add_argument("--batch", action="store_true", help="send every system's questions as one batch through the "
                   "server's Batch API (no per-question latency then)")
    p.add_argument("--url", help="a running server's /v1 URL (default: start one for the run)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused"))
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per request")
    eval_choices.add_arguments(p)
