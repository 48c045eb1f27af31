"""chorus's engine and vLLM on the same family checkpoint, token for token: greedy ids and per-token logprobs.

`chorus_answers` runs chorus's transformers engine in this process; `vllm_answers` runs vLLM's offline engine in
vLLM's own Python (``make vllm``), every checkpoint in one process (`chorus.engines.families.on_vllm.greedy`);
`parity` compares the two. Prompts go in as token ids, so both sides see the same tokens. The family tests and
``chorus bench families-vllm`` use these."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: prompts both sides answer: a completion, code and a chat turn (rendered with the checkpoint's template)
TEXTS = ("The capital of France is", "def fibonacci(n):")
CHAT = "What is 12 times 7?"


def prompt_ids(tokenizer_dir: Path | str) -> list[list[int]]:
    """The prompts as token ids of the tokenizer at ``tokenizer_dir``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    chat = tok.apply_chat_template([{"role": "user", "content": CHAT}], add_generation_prompt=True, tokenize=True,
                                   return_dict=True)["input_ids"]
    return [list(tok(t)["input_ids"]) for t in TEXTS] + [list(chat)]


async def chorus_answers(model_dir: Path | str, prompts: list[list[int]], max_tokens: int,
                         options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Greedy answers of chorus's transformers engine (float32): ids, text and the chosen tokens' logprobs."""
    from chorus.engines.core.base import GenerationRequest, SamplingParams
    from chorus.engines.core.spec import ModelSpec
    from chorus.engines.transformers.engine import TransformersEngine

    engine = TransformersEngine.load(ModelSpec(name="parity", path=str(model_dir)))
    await engine.start()
    try:
        rows = []
        for ids in prompts:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=True, ignore_eos=True)
            g = await engine.generate(GenerationRequest(list(ids), params, options=dict(options or {})))
            c = g.choices[0]
            rows.append({"ids": c.token_ids, "text": c.text, "logprobs": [lp.logprob for lp in c.logprobs or []]})
        return rows
    finally:
        await engine.aclose()


def vllm_python() -> Path:
    """vLLM's Python: ``CHORUS_VLLM_PYTHON``, or the ``.venv-vllm`` of ``make vllm`` in this source tree."""
    root = Path(__file__).resolve().parents[2]
    return Path(os.environ.get("CHORUS_VLLM_PYTHON", root / ".venv-vllm" / "bin" / "python"))


def vllm_answers(model_dirs: list[Path], prompts: list[list[int]], max_tokens: int,
                 log: Path | None = None, timeout: float = 1800) -> list[dict[str, Any]]:
    """Greedy answers of vLLM's offline engine for each checkpoint (one process, one model after another)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"models": [str(d) for d in model_dirs], "prompts": prompts,
                                    "max_tokens": max_tokens, "logprobs": 5}))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
        done = subprocess.run([str(vllm_python()), "-m", "chorus.engines.families.on_vllm.greedy", str(spec),
                               str(out)], env=env, capture_output=True, text=True, timeout=timeout)
        if log is not None:
            log.write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            raise RuntimeError(f"vLLM exited with {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}")
        return list(json.loads(out.read_text()))


@dataclass
class Parity:
    """One checkpoint's comparison over the prompts: answers with the same ids, tokens compared, the largest
    |logprob difference| over tokens both chose at the same position with the same history, and the first
    diverging (prompt, step) if any."""

    same_answers: int
    prompts: int
    tokens: int
    max_logprob_diff: float
    first_divergence: tuple[int, int] | None

    @property
    def identical(self) -> bool:
        return self.same_answers == self.prompts


def parity(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> Parity:
    same, tokens, worst, first = 0, 0, 0.0, None
    for p, (a, b) in enumerate(zip(ours, theirs)):
        same += a["ids"] == b["ids"]
        for step, (x, y) in enumerate(zip(a["ids"], b["ids"])):
            if x != y:
                first = first or (p, step)
                break
            tokens += 1
            worst = max(worst, abs(a["logprobs"][step] - b["logprobs"][step]))
    return Parity(same, len(ours), tokens, worst, first)
