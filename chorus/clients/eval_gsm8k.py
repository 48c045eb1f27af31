"""`chorus eval gsm8k`: GSM8K answers of served models, sampled through a running chorus and cached per item, for
the answer-side ensembles' evidence (`chorus bench answers` reads the cache and builds the tables).

For each item of ``--split`` (``train.jsonl`` or ``test.jsonl`` of ``--data-dir``) and each ``--model``:

- one greedy answer (temperature 0);
- ``--k`` sampled answers at ``--temperature``, drawn in requests of ``--batch`` choices (``n``), sample ``j`` of
  item ``i`` seeded ``seed + 1000 i + j`` (chorus seeds choice ``c`` of a request with ``seed + c``), so a cache
  extended from k = 8 to 16 keeps the first 8 and a rerun draws the same samples.

One prompt for every model and sample: the question, a blank line, and ``INSTRUCTION`` (zero-shot chain of
thought ending in "The answer is N"), as one user message through ``/v1/chat/completions``, at most
``--max-tokens`` tokens. Requests go one at a time, so each request's wall time is what that item's answers
cost on this machine (a batch's ``n`` choices decode together, as the served strategies draw them).

``--items FILE`` samples another labelled set instead: JSONL rows of ``{"prompt": ..., "answer": ...}`` (the
seeded addition set that ``chorus eval addition --write`` writes), each prompt sent as it is to
``/v1/completions``, stopped at the line's end, its answer the first number of the completion (the rule of
`eval_generative`, learned routing's labelled items, whose request it shares); the cache layout is the same
(``--split`` names its folder), so ``chorus bench answers`` reads it.

The cache is one JSON line per request (``docs/data/gsm8k/SPLIT/MODEL.jsonl``, committed: the next session resumes it): item, kind (greedy / sample), seed,
each choice's text, extracted answer and completion tokens, and the request's seconds. A rerun sends only
what is missing: a run can stop at any point and be resumed or extended (more items, larger k).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from chorus.clients.eval_generative import choice_text, first_number, request
from chorus.ensembles.answers.extract import extract_answer

INSTRUCTION = 'Solve the problem step by step, and end with "The answer is N", where N is a number.'
SEED = 1_000_000


def prompt(question: str) -> str:
    return f"{question}\n\n{INSTRUCTION}"


def reference(answer: str) -> str:
    """GSM8K's final answer: the number after ``####``, commas dropped."""
    return answer.rsplit("####", 1)[-1].strip().replace(",", "")


def same_number(a: str, b: str) -> bool:
    """Numeric answers compared as numbers ("72", "72.0" and "72.00" are one answer); empty is never right."""
    try:
        return a != "" and float(a) == float(b)
    except ValueError:
        return False


def items(data_dir: Path, split: str, start: int, count: int, path: Path | None = None) -> list[dict[str, Any]]:
    """Rows ``start`` .. ``start + count - 1`` of GSM8K's split (or of ``path``), each with its ``index``."""
    out = []
    with (path or data_dir / "gsm8k" / f"{split}.jsonl").open() as f:
        for i, line in enumerate(f):
            if i >= start + count:
                break
            if i >= start:
                out.append({"index": i, **json.loads(line)})
    return out


def cache_path(root: Path, split: str, model: str) -> Path:
    return root / split / f"{model}.jsonl"


def read(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ask(client: httpx.Client, url: str, model: str, item: dict[str, Any], *, n: int, temperature: float,
        seed: int | None, max_tokens: int) -> dict[str, Any]:
    """One request of ``n`` choices: a GSM8K question as a chat turn, or a labelled ``prompt`` as a completion
    stopped at the line's end."""
    chat = "prompt" not in item
    params: dict[str, Any] = {"model": model, "n": n, "temperature": temperature, "max_tokens": max_tokens}
    if seed is not None:
        params["seed"] = seed
    if temperature > 0:
        params["top_p"] = 1.0
    path, body = request(prompt(item["question"]) if chat else item["prompt"], chat, params)
    t0 = time.perf_counter()
    r = client.post(url + "/v1" + path, json=body)
    seconds = time.perf_counter() - t0
    r.raise_for_status()
    reply = r.json()
    choices = sorted(reply["choices"], key=lambda c: c["index"])
    per = reply["usage"]["completion_tokens"] / max(1, len(choices))
    texts = [choice_text(c, chat) for c in choices]
    return {"seconds": seconds, "prompt_tokens": reply["usage"]["prompt_tokens"],
            "choices": [{"text": t, "finish_reason": c["finish_reason"],
                         "answer": extract_answer(t, "number") if chat else first_number(t),
                         "tokens": c.get("completion_tokens", per)} for t, c in zip(texts, choices)]}


def main(args: argparse.Namespace) -> int:
    root = Path(args.cache)
    todo = items(Path(args.data_dir), args.split, args.start, args.count, Path(args.items) if args.items else None)
    with httpx.Client(timeout=args.timeout) as client:
        for model in args.model:
            path = cache_path(root, args.split, model)
            path.parent.mkdir(parents=True, exist_ok=True)
            done = read(path)
            greedy = {r["item"] for r in done if r["kind"] == "greedy"}
            seeds = {(r["item"], r["seed"]) for r in done if r["kind"] == "sample"}
            with path.open("a") as out:
                for it in todo:
                    i = it["index"]
                    wanted = [("greedy", None, 1)] if i not in greedy and not args.no_greedy else []
                    wanted += [("sample", SEED + 1000 * i + j, args.batch) for j in range(0, args.k, args.batch)
                               if (i, SEED + 1000 * i + j) not in seeds]
                    for kind, seed, n in wanted:
                        got = ask(client, args.url, model, it, n=n,
                                  temperature=0.0 if kind == "greedy" else args.temperature, seed=seed,
                                  max_tokens=args.max_tokens)
                        row = {"item": i, "kind": kind, "seed": seed, "temperature": 0.0 if kind == "greedy"
                               else args.temperature, "max_tokens": args.max_tokens, "reference":
                               reference(str(it["answer"])), **got}
                        out.write(json.dumps(row) + "\n")
                        out.flush()
                        right = sum(same_number(c["answer"], row["reference"]) for c in got["choices"])
                        print(f"{args.split} {model} item {i} {kind} seed {seed}: {right}/{len(got['choices'])} "
                              f"right, {got['seconds']:.1f}s", file=sys.stderr, flush=True)
    return 0


def cache_arguments(p: argparse.ArgumentParser, model_help: str) -> None:
    """The options every command over the GSM8K answer cache takes: the server, its models, the data, the cache."""
    p.add_argument("--url", default="http://127.0.0.1:8000", help="a running chorus")
    p.add_argument("--model", action="append", required=True, help=model_help)
    p.add_argument("--data-dir", default="../shared/data", help="holds gsm8k/train.jsonl and gsm8k/test.jsonl")
    p.add_argument("--split", choices=["train", "test"], default="test")
    p.add_argument("--cache", default="docs/data/gsm8k", help="the answer cache (a rerun sends only what is missing)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    cache_arguments(p, "a served model (repeat for several)")
    p.add_argument("--items", help="sample this JSONL of {prompt, answer} rows instead of GSM8K's split (e.g. the "
                                   "addition set of `chorus eval addition --write`); --split names its cache folder")
    p.add_argument("--start", type=int, default=0, help="first item (0-based line of the split's file)")
    p.add_argument("--count", type=int, default=50, help="items from --start")
    p.add_argument("--k", type=int, default=8, help="sampled answers per item (a multiple of --batch)")
    p.add_argument("--batch", type=int, default=4, help="choices per sampling request (n)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=320)
    p.add_argument("--no-greedy", action="store_true", help="samples only")
    p.add_argument("--timeout", type=float, default=900.0)
