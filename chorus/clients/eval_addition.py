"""``chorus eval addition``: a generative check of token-level ensembles, through ``/v1/completions``.

Random 2- and 3-digit additions (``--seed``), each asked as a few-shot completion::

    12 + 7 = 19
    35 + 21 = 56
    48 + 36 = 84
    {a} + {b} =

greedy (temperature 0), up to 8 tokens, stopped at the line's end; a problem counts when the first
integer of the completion equals ``a + b`` (exact match). Both small default tokenizers split numbers
into single digits, so a token-level ensemble chooses the answer digit by digit. Systems are
``--model NAME`` and ``--ensemble JSON`` (with a ``label``, and optionally ``versus``: another system's
label); the table gives accuracy per digit count with Wilson 95% intervals and, for each ensemble, the
difference from its best member on the same problems (paired bootstrap 95% interval, McNemar's exact
p), and from its ``versus`` system (e.g. selective against full averaging).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from chorus import stats as S
from chorus.clients.local import markdown_table

SHOTS = "12 + 7 = 19\n35 + 21 = 56\n48 + 36 = 84\n"
NUMBER = re.compile(r"-?\d+")


def problems(digits: list[int], n: int, seed: int) -> list[tuple[int, int, int]]:
    """``n`` problems per digit count: (digits, a, b) with both operands of that many digits."""
    rng = random.Random(seed)
    return [(d, rng.randrange(10 ** (d - 1), 10**d), rng.randrange(10 ** (d - 1), 10**d)) for d in digits
            for _ in range(n)]


@dataclass
class System:
    label: str
    body: dict[str, Any]
    members: list[str] = field(default_factory=list)
    versus: str | None = None  # another system to compare with on the same problems (e.g. full averaging)
    right: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


def is_right(text: str, a: int, b: int) -> bool:
    m = NUMBER.search(text)
    return m is not None and int(m.group()) == a + b


async def run(http: httpx.AsyncClient, system: System, probs: list[tuple[int, int, int]], concurrency: int) -> None:
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, a: int, b: int) -> tuple[int, bool, float]:
        body = {**system.body, "prompt": f"{SHOTS}{a} + {b} =", "temperature": 0, "max_tokens": 8, "stop": ["\n"]}
        async with gate:
            t0 = time.perf_counter()
            r = await http.post("/completions", json=body)
            dt = time.perf_counter() - t0
        if r.status_code != 200:
            raise SystemExit(f"chorus eval addition: {system.label}: {r.status_code}: {r.text[:300]}")
        return i, is_right(r.json()["choices"][0]["text"], a, b), dt

    done = await asyncio.gather(*(one(i, a, b) for i, (_, a, b) in enumerate(probs)))
    system.right = [int(ok) for _, ok, _ in sorted(done)]
    system.seconds = [dt for _, _, dt in sorted(done)]


def report(systems: list[System], probs: list[tuple[int, int, int]], digits: list[int]) -> str:
    by_label = {s.label: s for s in systems}
    header = ["system", *(f"{d}-digit acc [95% CI]" for d in digits), "Δ vs best member [95% CI]", "McNemar p",
              "s/problem"]
    if any(s.versus for s in systems):
        header.insert(-1, "Δ vs reference [95% CI], p")
    rows = []
    for s in systems:
        right = np.array(s.right)
        cells = [s.label]
        for d in digits:
            sel = right[[i for i, p in enumerate(probs) if p[0] == d]]
            lo, hi = S.accuracy_interval(sel)
            cells.append(f"{100 * sel.mean():.1f} [{100 * lo:.1f}, {100 * hi:.1f}]")
        members = [m for m in s.members if m in by_label]
        if members:
            best = max(members, key=lambda m: np.mean(by_label[m].right))
            diff = S.paired_difference(right, np.array(by_label[best].right))
            cells += [f"{100 * diff.delta:+.1f} [{100 * diff.low:+.1f}, {100 * diff.high:+.1f}] vs {best} "
                      f"(+{diff.wins}/-{diff.losses})", f"{diff.p_mcnemar:.3f}"]
        else:
            cells += ["-", "-"]
        if "Δ vs reference [95% CI], p" in header:
            ref = by_label.get(s.versus or "")
            if ref is None:
                cells.append("-")
            else:
                vs = S.paired_difference(right, np.array(ref.right))
                cells.append(f"{100 * vs.delta:+.1f} [{100 * vs.low:+.1f}, {100 * vs.high:+.1f}] vs {ref.label} "
                             f"(+{vs.wins}/-{vs.losses}), p {vs.p_mcnemar:.3f}")
        cells.append(f"{np.mean(s.seconds):.2f}")
        rows.append(cells)
    return markdown_table(header, rows)


async def evaluate(args: argparse.Namespace, url: str, headers: dict[str, str]) -> str:
    digits = [int(d) for d in args.digits.split(",")]
    probs = problems(digits, args.n, args.seed)
    systems = [System(m, {"model": m}) for m in args.model or []]
    for i, raw in enumerate(args.ensemble or []):
        spec = json.loads(raw)
        label = spec.pop("label", None) or f"{spec.get('strategy', 'ensemble')}#{i + 1}"
        versus = spec.pop("versus", None)
        members = [m if isinstance(m, str) else m["model"] for m in spec.get("members") or []]
        systems.append(System(label, {"model": label, "ensemble": spec}, members, versus))
    if not systems:
        raise SystemExit("chorus eval addition: give at least one --model or --ensemble")
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, headers=headers) as http:
        for s in systems:
            print(f"{s.label}: {len(probs)} problems ...", file=sys.stderr, flush=True)
            await run(http, s, probs, args.concurrency)
    return (f"{args.n} problems per digit count (seed {args.seed}), few-shot completion, greedy, exact match\n"
            + report(systems, probs, digits))


def write_set(path: str, digits: list[int], n: int, seed: int) -> None:
    """The same problems as labelled generative rows (``prompt`` / ``answer``, ``digits``), in the shape
    ``chorus train selector`` and ``chorus bench selector`` read (chorus/clients/eval_generative.py)."""
    with open(path, "w") as f:
        for i, (d, a, b) in enumerate(problems(digits, n, seed)):
            f.write(json.dumps({"id": f"add-{seed}-{i}", "prompt": f"{SHOTS}{a} + {b} =", "answer": str(a + b),
                                "digits": d}) + "\n")
    print(f"{n * len(digits)} problems ({n} per digit count {', '.join(map(str, digits))}, seed {seed}) -> {path}")


def main(args: argparse.Namespace) -> int:
    from chorus.clients.eval import serving

    if args.write:
        write_set(args.write, [int(d) for d in args.digits.split(",")], args.n, args.seed)
        return 0
    with serving(args) as url:
        print(asyncio.run(evaluate(args, url, {"Authorization": f"Bearer {args.api_key}"})))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", help="a served model (repeatable)")
    p.add_argument("--ensemble", action="append", help='an ensemble as JSON with a "label" (repeatable)')
    p.add_argument("--digits", default="2,3", help="digit counts, comma separated")
    p.add_argument("--n", type=int, default=50, help="problems per digit count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--url", help="a running server's /v1 URL (default: start one for the run)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused"))
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--write", metavar="FILE", help="write the problems as labelled JSONL (prompt, answer) for "
                   "chorus train selector / bench selector, and call no model")
