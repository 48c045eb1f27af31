"""chorus's engine and vLLM on the same family checkpoint, token for token: greedy ids and per-token logprobs.

`chorus_answers` runs chorus's transformers engine in this process; `VllmGreedy` runs vLLM's offline engine in
vLLM's own Python (``make vllm``), every checkpoint in one process (`chorus.engines.families.on_vllm.greedy`);
`parity` compares the two. Prompts go in as token ids, so both sides see the same tokens. The family tests and
``chorus bench families-vllm`` use these."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: prompts both sides answer: a completion, code and a chat turn (rendered with the checkpoint's template)
TEXTS = ("The capital of France is", "def fibonacci(n):")
CHAT = "What is 12 times 7?"


def prompt_ids(tokenizer_dir: Path | str) -> list[list[int]]:
    """The prompts as token ids of the tokenizer at ``tokenizer_dir``."""
    from transformers import AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(tokenizer_dir)
    chat = tok.apply_chat_template([{"role": "user", "content": CHAT}], add_generation_prompt=True, tokenize=True,
                                   return_dict=True)["input_ids"]
    return [list(tok(t)["input_ids"]) for t in TEXTS] + [list(chat)]


async def chorus_answers(model_dir: Path | str, prompts: list[list[int]], max_tokens: int,
                         options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Greedy answers of chorus's transformers engine (float32): ids, text, the chosen tokens' logprobs and what
    the family reported (the request's trace: expert load, MoDr branches, ReasonFormer depth)."""
    from chorus.engines.core.base import GenerationRequest, SamplingParams
    from chorus.engines.core.spec import ModelSpec
    from chorus.engines.transformers.engine import TransformersEngine

    engine = TransformersEngine.load(ModelSpec(name="parity", path=str(model_dir)))
    await engine.start()
    try:
        rows = []
        for ids in prompts:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=True, ignore_eos=True)
            req = GenerationRequest(list(ids), params, options=dict(options or {}), trace={})
            g = await engine.generate(req)
            c = g.choices[0]
            rows.append({"ids": c.token_ids, "text": c.text, "logprobs": [lp.logprob for lp in c.logprobs or []],
                         "trace": req.trace})
        return rows
    finally:
        await engine.aclose()


def vllm_python() -> Path:
    """vLLM's Python: ``CHORUS_VLLM_PYTHON``, or the ``.venv-vllm`` of ``make vllm`` in this source tree."""
    root = Path(__file__).resolve().parents[2]
    return Path(os.environ.get("CHORUS_VLLM_PYTHON", root / ".venv-vllm" / "bin" / "python"))


class VllmGreedy:
    """vLLM's offline engine in its own process (vLLM's Python), given one checkpoint at a time: `answer` returns
    as soon as that checkpoint is answered, so the caller may delete it before deriving the next (one process
    start for all of them; ``log`` takes what vLLM printed)."""

    def __init__(self, prompts: list[list[int]], max_tokens: int, log: Path | None = None,
                 timeout: float = 1800) -> None:
        self.prompts, self.max_tokens, self.timeout = prompts, max_tokens, timeout
        self.tmp = Path(tempfile.mkdtemp(prefix="chorus-vllm-greedy-"))
        self.log = log or self.tmp / "vllm.log"
        self.out = self.tmp / "out.jsonl"
        self.got = 0

    def __enter__(self) -> VllmGreedy:
        spec = self.tmp / "spec.json"
        spec.write_text(json.dumps({"prompts": self.prompts, "max_tokens": self.max_tokens, "logprobs": 5}))
        self.out.touch()
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
        with self.log.open("w") as log:
            self.proc = subprocess.Popen([str(vllm_python()), "-m", "chorus.engines.families.on_vllm.greedy",
                                          str(spec), str(self.out), "--stdin"], env=env, stdin=subprocess.PIPE,
                                         stdout=log, stderr=subprocess.STDOUT, text=True)
        return self

    def answer(self, model_dir: Path) -> dict[str, Any]:
        """The checkpoint's answers (as `chorus.engines.families.on_vllm.greedy` writes them)."""
        import time

        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{model_dir}\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + self.timeout
        while True:
            lines = self.out.read_text().splitlines()
            if len(lines) > self.got:
                self.got += 1
                return dict(json.loads(lines[self.got - 1]))
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"vLLM exited with {self.proc.wait()} before answering {model_dir}:\n"
                                   f"{self.log.read_text(errors='replace')[-4000:]}")
            time.sleep(0.5)

    def __exit__(self, *exc: object) -> None:
        import shutil

        assert self.proc.stdin is not None
        self.proc.stdin.close()  # (its end of the models: it exits)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


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


#: the checkpoints `derive_checkpoints` writes: name -> (family, how it is served on vLLM)
CHECKPOINTS = {
    "moe-mixtral": ("MoE, Mixtral layout (upcycled)", "native"),
    "moe-qwen2": ("MoE, Qwen2-MoE layout (upcycled)", "native"),
    "moe-deepseek": ("MoE, DeepSeek-V3 blocks (upcycled)", "native"),
    "moe-switch": ("MoE after chorus train moe --router switch", "native"),
    "moe-gshard": ("MoE after chorus train moe --router gshard", "native"),
    "moe-deepseek-trained": ("MoE after chorus train moe --router deepseek", "native"),
    "graft": ("SOLAR-style grafted", "native"),
    "modr": ("MoDr", "chorus's plugin"),
    "reasonformer-shared": ("ReasonFormer, shared skills", "chorus's plugin"),
    "reasonformer-private": ("ReasonFormer, private skills", "chorus's plugin"),
}


def derive_checkpoints(base: Path, out: Path, names: list[str] | None = None,
                       log: Any = lambda _: None) -> dict[str, Path]:
    """Freshly derived family checkpoints of ``base`` (a Llama checkpoint) under ``out``, made so that their own
    parts matter: expert copies with noise, trained routers, MoDr branches and ReasonFormer skills with random
    (non-zero) LoRAs, routers that spread their weight and stop gates near the threshold."""
    return dict(derived_checkpoints(base, out, names, log))


def derived_checkpoints(base: Path, out: Path, names: list[str] | None = None,
                        log: Any = lambda _: None) -> Iterator[tuple[str, Path]]:
    """`derive_checkpoints` one at a time, the same checkpoints in the same order (one random generator): a
    caller that is done with one may delete it before the next is written."""
    import torch

    from chorus.engines.families.graft import GraftConfig, graft
    from chorus.engines.families.modr import build_retrofit as modr_retrofit
    from chorus.engines.families.modr import load_modr, save_modr
    from chorus.engines.families.moe import UpcycleConfig, upcycle
    from chorus.engines.families.reasonformer import build_retrofit as rf_retrofit
    from chorus.engines.families.reasonformer import load_reasonformer, save_reasonformer
    from chorus.training.moe import MoeTrainConfig, train_moe

    gen = torch.Generator().manual_seed(0)
    rand = lambda t, std: torch.randn(t.shape, generator=gen) * std  # noqa: E731
    data = out / "train.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    data.write_text("\n".join(json.dumps({"question": f"Tom has {a} apples and buys {b} more. How many now?",
                                          "answer": str(a + b)}) for a in range(20) for b in range(3)))
    for name in names or list(CHECKPOINTS):
        d = out / name
        layout = {"moe-mixtral": "mixtral", "moe-qwen2": "qwen2_moe", "moe-deepseek": "deepseek_v3"}.get(name)
        router = {"moe-switch": "switch", "moe-gshard": "gshard", "moe-deepseek-trained": "deepseek"}.get(name)
        if layout:
            upcycle(base, d, UpcycleConfig(experts=4, top_k=2, layout=layout, noise=0.05),  # type: ignore[arg-type]
                    force=True, log=log)
        elif router:
            tc = MoeTrainConfig(router=router, experts=2, steps=2, batch_size=2, seq_len=32, lr=1e-3,
                                eval_sequences=2, log_every=100)
            train_moe(base, data, d, tc, force=True, log=log)
        elif name == "graft":
            graft(base, d, GraftConfig(drop=8), force=True, log=log)
        elif name == "modr":
            fresh = modr_retrofit(base, out / "modr-fresh", {"recurrence": 2, "rank": 8}, force=True, log=log)
            m = load_modr(fresh)
            with torch.no_grad():
                for branch in m.loras:
                    branch.B.copy_(rand(branch.B, 0.02))
                m.router.weight.copy_(rand(m.router.weight, 0.5))
            _replace(d, fresh, save_modr, m)
        elif name.startswith("reasonformer-"):
            kind = name.split("-", 1)[1]
            fresh = rf_retrofit(base, out / f"{name}-fresh", {"kind": kind, "max_steps": 3, "top_k": 2},
                                force=True, log=log)
            rf = load_reasonformer(fresh)
            with torch.no_grad():
                for skill in rf.loras:
                    for b in skill.B:
                        b.copy_(rand(b, 0.02))
                skill_router: Any
                for skill_router in rf.routers:
                    skill_router.out.weight.copy_(rand(skill_router.out.weight, 0.01))
                gate: Any
                for gate in rf.gates:
                    gate.out.weight.copy_(rand(gate.out.weight, 0.002))
                    gate.out.bias.fill_(0.0)
                # the threshold between the two lowest step-2 gates of the parity prompts: one of them stops after
                # step 1, the others go on (a margin either side, so both engines' rounding agree)
                rf.cfg.stop_threshold = 0.0
                gates = []
                for ids in prompt_ids(base):
                    rf(torch.tensor([ids]))
                    gates.append(float(rf.reports[0].gates[1] or 0.0))
                low = sorted(gates)
                rf.cfg.stop_threshold = round((low[0] + low[1]) / 2, 6)
            _replace(d, fresh, save_reasonformer, rf)
        else:
            raise ValueError(f"unknown family checkpoint {name!r} (known: {', '.join(CHECKPOINTS)})")
        yield name, d


def _replace(d: Path, fresh: Path, save: Any, model: Any) -> None:
    """``save(model, d)`` into ``d`` (emptied first), then ``fresh`` (the untrained retrofit it came from) removed."""
    import shutil

    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    save(model, d)
    shutil.rmtree(fresh)
