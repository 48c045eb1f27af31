"""Greedy answers and per-token logprobs from vLLM's offline engine, one checkpoint after another in one process:
what the family tests and ``chorus bench families-vllm`` compare with chorus's own engine.

Run with vLLM's Python (``make vllm``)::

    .venv-vllm/bin/python -m chorus.engines.families.on_vllm.greedy SPEC.json OUT.json
    .venv-vllm/bin/python -m chorus.engines.families.on_vllm.greedy SPEC.json OUT.jsonl --stdin

SPEC: ``{"models": [DIR, ...], "prompts": [[token ids], ...], "max_tokens": N, "logprobs": K}``; OUT: per model,
per prompt, the generated ids, the chosen token's logprob per step and the top-K per step (token id -> logprob).
With ``--stdin`` the models come one directory per line on stdin (SPEC's ``models`` is not read) and each
model's answers are one line of OUT, written as soon as they are known: a caller that derives checkpoints one at a
time deletes each once answered (ten float32 checkpoints at once are about 10 GB). Prompts go in as token ids, so
both sides see the same tokens whatever their chat templates."""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path
from typing import Any


def answers(model: str, prompts: list[list[int]], max_tokens: int, logprobs: int, **engine: Any) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
              enable_prefix_caching=False, **engine)
    loaded = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    rows = []
    for out in outs:
        c = out.outputs[0]
        steps = c.logprobs or []
        rows.append({"ids": list(c.token_ids), "text": c.text,
                     "logprobs": [step[t].logprob for step, t in zip(steps, c.token_ids)],
                     "top": [{str(k): v.logprob for k, v in step.items()} for step in steps]})
    del llm
    gc.collect()
    return {"model": model, "load_s": round(loaded, 1), "answers": rows}


def main(argv: list[str]) -> None:
    spec = json.loads(Path(argv[0]).read_text())
    ask = lambda m: answers(m, spec["prompts"], spec.get("max_tokens", 16), spec.get("logprobs", 5))  # noqa: E731
    if "--stdin" not in argv[2:]:
        Path(argv[1]).write_text(json.dumps([ask(m) for m in spec["models"]]))
        return
    with Path(argv[1]).open("a") as out:
        for line in sys.stdin:
            if line.strip():
                out.write(json.dumps(ask(line.strip())) + "\n")
                out.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
