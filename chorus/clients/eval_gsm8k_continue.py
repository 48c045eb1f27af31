"""`chorus eval gsm8k-continue`: every answer of the GSM8K cache that was cut at its token cap, continued to a larger
budget by the same model, so that the evidence measures the model and not the cap.

For each choice of ``docs/data/gsm8k/SPLIT/MODEL.jsonl`` whose ``finish_reason`` is ``length``: one chat request with
the question as the user turn and the cut answer as the assistant's partial turn, ``continue_final_message: true``
(the gateway renders the chat template up to the generation prompt and appends the partial text), at the original
request's temperature, ``max_tokens`` = ``--budget`` minus the tokens already drawn. A sampled continuation of a
partial sample at the same temperature, from the same model, is a sample of the whole answer at the larger budget;
a greedy continuation is the greedy answer up to the batch-shape rounding the configuration docs describe (the
partial text is re-tokenized, which can split a word differently from the draw). Only the missing tokens are paid.

The continuations go to ``MODEL.continued.jsonl`` beside the cache, one line per choice: ``item``, ``kind``,
``seed`` (the original request's), ``choice`` (its index there), ``budget``, the continuation's ``text``,
``finish_reason`` and ``tokens``, the whole answer's extracted ``answer``, and the request's ``seconds``. Resumable:
a rerun sends only the choices not yet continued. ``--concurrency`` requests in flight let the engine batch them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from chorus.clients.eval_gsm8k import SEED, cache_arguments, cache_path, items, prompt, read, same_number
from chorus.ensembles.answers.extract import extract_answer


def continued_path(root: Path, split: str, model: str) -> Path:
    return cache_path(root, split, model).with_suffix(".continued.jsonl")


def scored_path(root: Path, split: str, model: str) -> Path:
    """Where `chorus eval gsm8k-score` keeps the cached answers' token log-probabilities."""
    return cache_path(root, split, model).with_suffix(".scored.jsonl")


def cut_choices(rows: list[dict[str, Any]]) -> list[tuple[dict[str, Any], int]]:
    """(request row, choice index) of every choice that ended at the cap."""
    return [(r, c) for r in rows for c, ch in enumerate(r["choices"]) if ch["finish_reason"] == "length"]


def key(row: dict[str, Any], choice: int) -> tuple[int, str, int | None, int]:
    return (row["item"], row["kind"], row["seed"], choice)


def post(client: httpx.Client, url: str, body: dict[str, Any], tries: int = 3) -> tuple[httpx.Response, float]:
    """The response and its seconds; a 5xx or a dropped connection (a paused or restarted server) is tried again."""
    for attempt in range(tries):
        t0 = time.perf_counter()
        try:
            r = client.post(url, json=body)
        except httpx.TransportError:
            if attempt == tries - 1:
                raise
            continue
        if r.status_code < 500 or attempt == tries - 1:
            break
    return r, time.perf_counter() - t0


def continue_one(client: httpx.Client, url: str, model: str, question: str, row: dict[str, Any], choice: int,
                 budget: int) -> dict[str, Any] | None:
    partial = row["choices"][choice]
    drawn = round(partial["tokens"])
    body: dict[str, Any] = {
        "model": model, "temperature": row["temperature"], "max_tokens": max(1, budget - drawn),
        "messages": [{"role": "user", "content": prompt(question)},
                     {"role": "assistant", "content": partial["text"]}],
        "continue_final_message": True}
    if row["temperature"] > 0:
        # a fresh stream for the rest of the sample (any seed draws a valid continuation; this one is reproducible)
        body["seed"] = (row["seed"] or SEED) + 500 + choice
        body["top_p"] = 1.0
    r, seconds = post(client, url + "/v1/chat/completions", body)
    if r.status_code == 400:  # this choice cannot be continued as asked (e.g. the context is too short): said, skipped
        print(f"item {row['item']} {row['kind']} choice {choice}: {r.json().get('error', {}).get('message')}",
              file=sys.stderr, flush=True)
        return None
    r.raise_for_status()
    reply = r.json()
    text = reply["choices"][0]["message"]["content"] or ""
    return {"item": row["item"], "kind": row["kind"], "seed": row["seed"], "choice": choice, "budget": budget,
            "drawn": drawn, "text": text, "finish_reason": reply["choices"][0]["finish_reason"],
            "tokens": reply["usage"]["completion_tokens"], "prompt_tokens": reply["usage"]["prompt_tokens"],
            "answer": extract_answer(partial["text"] + text, "number"), "seconds": seconds}


def whole(rows: list[dict[str, Any]], continued: list[dict[str, Any]], budget: int = 768) -> list[dict[str, Any]]:
    """The cache's rows with every choice continued to ``budget`` made whole: the partial text and its
    continuation as one text, the whole answer's ``answer``, ``finish_reason`` and ``tokens``, and
    ``drawn_tokens`` (what the row's request drew: its ``seconds`` are for those, as measured; the continuation's
    ran beside others, so `chorus bench answers` charges the whole answer's tokens at the modeled rate). Choices
    not continued are as drawn."""
    more = {key(c, c["choice"]): c for c in continued if c["budget"] == budget}
    out = []
    for r in rows:
        choices = []
        for i, ch in enumerate(r["choices"]):
            c = more.get(key(r, i))
            choices.append(ch if c is None else {
                **ch, "text": ch["text"] + c["text"], "finish_reason": c["finish_reason"], "answer": c["answer"],
                "tokens": ch["tokens"] + c["tokens"], "drawn_tokens": ch["tokens"]})
        out.append({**r, "choices": choices})
    return out


def main(args: argparse.Namespace) -> int:
    root = Path(args.cache)
    for model in args.model:
        rows = read(cache_path(root, args.split, model))
        if not rows:
            print(f"chorus eval gsm8k-continue: no cache for {model} ({args.split}) under {root}", file=sys.stderr)
            return 2
        out_path = continued_path(root, args.split, model)
        done = {key(r, r["choice"]) for r in read(out_path) if r["budget"] == args.budget}
        todo = [(r, c) for r, c in cut_choices(rows) if key(r, c) not in done]
        if args.items is not None:
            todo = [(r, c) for r, c in todo if r["item"] < args.items]
        last = max(r["item"] for r in rows)
        questions = {it["index"]: it["question"] for it in items(Path(args.data_dir), args.split, 0, last + 1)}
        references = {r["item"]: r["reference"] for r in rows}
        print(f"{args.split} {model}: {len(todo)} cut answers to continue to {args.budget} tokens", file=sys.stderr,
              flush=True)
        with httpx.Client(timeout=args.timeout) as client, out_path.open("a") as out, \
                ThreadPoolExecutor(args.concurrency) as pool:
            # written in the order of the cache (pool.map keeps it), one line as each comes
            def one(rc: tuple[dict[str, Any], int], model: str = model,
                    questions: dict[int, str] = questions) -> dict[str, Any] | None:
                return continue_one(client, args.url, model, questions[rc[0]["item"]], rc[0], rc[1], args.budget)

            for got in pool.map(one, todo):
                if got is None:
                    continue
                out.write(json.dumps(got) + "\n")
                out.flush()
                right = same_number(got["answer"], references[got["item"]])
                print(f"{args.split} {model} item {got['item']} {got['kind']} choice {got['choice']}: +{got['tokens']} "
                      f"tokens, {got['finish_reason']}, {'right' if right else 'wrong'}, {got['seconds']:.1f}s",
                      file=sys.stderr, flush=True)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    cache_arguments(p, "a served model whose cache to continue (repeat for several)")
    p.add_argument("--budget", type=int, default=768, help="the whole answer's token budget")
    p.add_argument("--items", type=int, default=None, help="only items below this index")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (the engine batches them)")
    p.add_argument("--timeout", type=float, default=1800.0)
