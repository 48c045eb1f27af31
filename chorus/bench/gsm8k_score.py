"""`chorus eval gsm8k-score`: every cached GSM8K answer scored by the model that wrote it, token by token, so the
evidence can weigh samples by the model's own confidence without drawing them again.

For each choice of ``docs/data/gsm8k/SPLIT/MODEL.jsonl`` (made whole with its continuation where it was cut:
`eval_gsm8k_continue.whole`): one ``/v1/completions`` request with ``echo: true``, ``logprobs: K`` and
``max_tokens: 0`` whose prompt is the chat turn as the model's template renders it (the question, the generation
prompt) followed by the answer's text. The gateway scores the prompt (every token's log-probability under the
model and its top K alternatives, in one batched pass); the tokens from the answer's first character on are the
answer's. These are the numbers a served `answer_vote` reads from the draw itself (``logprobs`` of the
distribution before temperature, `engines/core/sampling.logprob_info`): scoring the text again gives the same
up to re-tokenization (a word the draw split differently) and batch-shape rounding.

Written to ``MODEL.scored.jsonl`` beside the cache, one line per choice: ``item``, ``kind``, ``seed``, ``choice``,
``budget`` (the continuation budget the text was made whole at), ``k``, and per answer token ``lp`` (its
log-probability, 3 decimals) and ``conf`` (DeepConf's token confidence: minus the mean log-probability of the
top K tokens, 2 decimals), the arrays `ensembles.confidence` summarises. Resumable: a rerun scores only what is
missing. Items in order, an item's choices together, so a stopped run leaves whole items.
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

from chorus.clients.eval_gsm8k import cache_arguments, cache_path, items, prompt, read
from chorus.clients.eval_gsm8k_continue import continued_path, key, post, scored_path, whole
from chorus.ensembles.answers.confidence import token_confidence


def chat_head(config: str | None, model: str) -> Any:
    """A function rendering a question as the served model's chat template does (the gateway's own code)."""
    from chorus.config import load_config
    from chorus.engines.llama_cpp.engine import gguf_of, tokenizer_for

    spec = load_config(config).model(model)
    tok = tokenizer_for(spec, gguf_of(spec))
    return lambda question: tok.render_chat([{"role": "user", "content": prompt(question)}])


def score_one(client: httpx.Client, url: str, model: str, head: str, row: dict[str, Any], choice: int, k: int,
              budget: int) -> dict[str, Any] | None:
    text = row["choices"][choice]["text"]
    body = {"model": model, "prompt": head + text, "echo": True, "logprobs": k, "max_tokens": 0}
    r, _ = post(client, url + "/v1/completions", body)
    if r.status_code == 400:  # e.g. longer than the model's context: said, skipped (the item stays unscored)
        print(f"item {row['item']} {row['kind']} choice {choice}: {r.json().get('error', {}).get('message')}",
              file=sys.stderr, flush=True)
        return None
    r.raise_for_status()
    echoed = r.json()["choices"][0]
    lps = echoed["logprobs"]
    # the echo is the prompt as its tokens decode (special tokens are not text), so the answer is its last
    # len(text) characters: the tokens that start there are the answer's
    start = len(echoed["text"]) - len(text)
    answer = [i for i, off in enumerate(lps["text_offset"]) if off >= start]
    lp = [round(float(lps["token_logprobs"][i]), 3) + 0.0 for i in answer]  # + 0.0: no "-0.0"
    conf = [round(token_confidence(list((lps["top_logprobs"][i] or {}).values())), 2) for i in answer]
    return {"item": row["item"], "kind": row["kind"], "seed": row["seed"], "choice": choice, "budget": budget,
            "k": k, "lp": lp, "conf": conf}


def main(args: argparse.Namespace) -> int:
    root = Path(args.cache)
    args.kind = args.kind or ["sample", "greedy"]
    for model in args.model:
        rows = whole(read(cache_path(root, args.split, model)), read(continued_path(root, args.split, model)),
                     args.budget)
        if not rows:
            print(f"chorus eval gsm8k-score: no cache for {model} ({args.split}) under {root}", file=sys.stderr)
            return 2
        out_path = scored_path(root, args.split, model)
        done = {key(r, r["choice"]) for r in read(out_path) if r["k"] == args.k and r["budget"] == args.budget}
        kinds = {"greedy": 1, "sample": 0}  # an item's samples first, then its greedy answer
        todo = sorted(((r, c) for r in rows for c in range(len(r["choices"])) if key(r, c) not in done),
                      key=lambda rc: (rc[0]["item"], kinds[rc[0]["kind"]], rc[0]["seed"] or 0, rc[1]))
        if args.items is not None:
            todo = [(r, c) for r, c in todo if r["item"] < args.items]
        todo = [(r, c) for r, c in todo if r["kind"] in args.kind]
        if args.samples is not None:  # each item's first N samples (seed order, as `chorus bench answers` reads them)
            seen: dict[int, int] = {}
            first = set()
            for i, seed, c in sorted((r["item"], r["seed"] or 0, c) for r in rows if r["kind"] == "sample"
                                     for c in range(len(r["choices"]))):
                seen[i] = seen.get(i, 0) + 1
                if seen[i] <= args.samples:
                    first.add((i, seed, c))
            todo = [(r, c) for r, c in todo if r["kind"] != "sample" or (r["item"], r["seed"] or 0, c) in first]
        print(f"{args.split} {model}: {len(todo)} answers to score (top {args.k})", file=sys.stderr, flush=True)
        if not todo:
            continue
        render = chat_head(args.config, model)
        last = max(r["item"] for r in rows)
        heads = {it["index"]: render(it["question"]) for it in items(Path(args.data_dir), args.split, 0, last + 1)}
        with httpx.Client(timeout=args.timeout) as client, out_path.open("a") as out, \
                ThreadPoolExecutor(args.concurrency) as pool:
            def one(rc: tuple[dict[str, Any], int], model: str = model,
                    heads: dict[int, str] = heads) -> tuple[dict[str, Any] | None, float]:
                t0 = time.perf_counter()
                got = score_one(client, args.url, model, heads[rc[0]["item"]], rc[0], rc[1], args.k, args.budget)
                return got, time.perf_counter() - t0

            for got, seconds in pool.map(one, todo):
                if got is None:
                    continue
                out.write(json.dumps(got, separators=(",", ":")) + "\n")
                out.flush()
                print(f"{args.split} {model} item {got['item']} {got['kind']} choice {got['choice']}: "
                      f"{len(got['lp'])} tokens, {seconds:.1f}s", file=sys.stderr, flush=True)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    cache_arguments(p, "a served model whose answers to score (repeat for several)")
    p.add_argument("--config", default="deploy/configs/qwen-llama.yaml",
                   help="the served config (its model entry gives the chat template the answers were drawn with)")
    p.add_argument("--budget", type=int, default=768, help="the continuation budget the answers are made whole at")
    p.add_argument("--k", type=int, default=20, help="top-k alternatives per token (token confidence's k)")
    p.add_argument("--items", type=int, default=None, help="only items below this index")
    p.add_argument("--kind", action="append", choices=["sample", "greedy"], default=None,
                   help="only these answers (repeat; default: both)")
    p.add_argument("--samples", type=int, default=None,
                   help="only each item's first N samples (default: all; greedy answers as --kind says)")
    p.add_argument("--concurrency", type=int, default=2, help="requests in flight")
    p.add_argument("--timeout", type=float, default=1800.0)
