"""`chorus bench llama-agreement`: how far llama.cpp's logits on a GGUF are from the transformers engine's on the
same file (dequantized to float32 by `chorus models prepare`).

llama.cpp multiplies the quantized weights with activations it quantizes too (8-bit blocks); transformers
multiplies the dequantized float32 weights with float32 activations. The two engines share one tokenizer, so
the comparison is position by position on the same token ids:

- a probe set (the ARC-Easy questions with their correct answers, as `/v1/choices` renders them): each
  engine's next-token distribution at every position; top-1 agreement, and the largest and the median absolute
  difference of the logprob each gives the token that comes next;
- accuracy on an ARC-Easy and a PIQA slice, each engine scoring the choices (sum of the choice's token
  logprobs after the question, as `/v1/choices` does with ``normalisations: sum``), with Wilson intervals,
  and how often the two pick the same choice.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import torch

from chorus import stats as S


def arc_prompt(item: dict[str, Any]) -> str:
    return f"Question: {item['question']}\nAnswer:"


def piqa_prompt(item: dict[str, Any]) -> str:
    return f"Question: {item['goal']}\nAnswer:"


def rows(path: Path, n: int) -> list[dict[str, Any]]:
    out = []
    with path.open() as f:
        for line in f:
            out.append(json.loads(line))
            if len(out) == n:
                break
    return out


async def run(args: argparse.Namespace) -> str:
    from chorus.config import load_config
    from chorus.engines.core.spec import ModelSpec
    from chorus.engines.llama_cpp.engine import LlamaCppEngine
    from chorus.engines.transformers.engine import TransformersEngine

    torch.set_num_threads(args.threads)
    config = load_config(args.config)
    base = config.model(args.model)
    if base.engine == "llama_cpp":  # the transformers side: the entry of the config with the same GGUF
        twins = [m for m in config.models if m.engine == "transformers" and m.source == base.source and
                m.path == base.path and m.derive is None]
        if not twins:
            where = base.source or base.path
            raise SystemExit(f"{args.model}: no transformers entry of the config has its GGUF ({where}) to compare "
                             "with; add one (chorus models prepare dequantizes it)")
        base = twins[0]
    tf = TransformersEngine.load(base)
    ll = LlamaCppEngine.load(ModelSpec.model_validate({
        "name": f"{base.name}-llama", "engine": "llama_cpp", "source": base.sources,
        "path": None if base.source else base.path, "max_batch_size": 4, "max_model_len": 2048,
        "llama_cpp": {"threads": args.threads}}))
    await tf.start()
    await ll.start()
    tok = tf.tokenizer
    try:
        data = Path(args.data_dir)
        arc = rows(data / "arc-easy" / "test.jsonl", args.items)
        agree = total = 0
        diffs: list[float] = []
        for item in arc[: args.probe]:
            ids = tok.encode(arc_prompt(item) + " " + item["choices"][item["label"]])
            a = await tf.prompt_logprobs(ids, 1)
            b = await ll.prompt_logprobs(ids, 1)
            for x, y in zip(a[1:], b[1:]):
                assert x is not None and y is not None
                agree += x.top[0].token == y.top[0].token
                total += 1
                diffs.append(abs(x.logprob - y.logprob))
        lines = [f"chorus bench llama-agreement: {base.name}, transformers (float32, dequantized) vs llama.cpp (the "
                 f"GGUF as it is), {args.threads} threads", "",
                 f"probe: {args.probe} ARC-Easy question + answer texts, {total} positions",
                 f"- top-1 agreement {100 * agree / total:.1f}%",
                 f"- |logprob difference| of the next token: median {statistics.median(diffs):.4f}, "
                 f"max {max(diffs):.4f}", "",
                 "| set | n | transformers acc [95% CI] | llama.cpp acc [95% CI] | same choice |",
                 "|---|---:|---|---|---:|"]
        piqa = rows(data / "piqa" / "validation.jsonl", args.items)
        for name, items, prompt in (("ARC-Easy test", arc, arc_prompt), ("PIQA validation", piqa, piqa_prompt)):
            picks: dict[str, list[int]] = {"tf": [], "ll": []}
            gold = []
            for item in items:
                prefix = tok.encode(prompt(item))
                conts = [tok.encode(prompt(item) + " " + c)[len(prefix):] for c in item["choices"]]
                for key, eng in (("tf", tf), ("ll", ll)):
                    scores = await eng.score_continuations(prefix, conts)
                    picks[key].append(int(np.argmax([sum(s) for s in scores])))
                gold.append(int(item["label"]))
            cells = [name, str(len(items))]
            for key in ("tf", "ll"):
                right = np.array([p == g for p, g in zip(picks[key], gold)], dtype=float)
                lo, hi = S.accuracy_interval(right)
                cells.append(f"{100 * right.mean():.1f} [{100 * lo:.1f}, {100 * hi:.1f}]")
            same = np.mean([a == b for a, b in zip(picks["tf"], picks["ll"])])
            cells.append(f"{100 * same:.1f}%")
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)
    finally:
        await tf.aclose()
        await ll.aclose()


def main(args: argparse.Namespace) -> int:
    print(asyncio.run(run(args)))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="a config model whose source is a GGUF (transformers entry, prepared, or an engine: llama_cpp "
                        "entry with a transformers twin)")
    p.add_argument("--data-dir", default="../shared/data", help="holds arc-easy/test.jsonl and piqa/validation.jsonl")
    p.add_argument("--items", type=int, default=200, help="items per accuracy set")
    p.add_argument("--probe", type=int, default=50, help="question + answer texts in the probe set")
    p.add_argument("--threads", type=int, default=2)
