"""Multiple-choice scoring on the real models: ``/v1/choices`` equals the model run directly with
transformers, the shared-prefix path equals scoring each choice whole, and lm-evaluation-harness's
``local-completions`` through chorus gets the same log-likelihoods."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from chorus.clients.lm_eval_tasks import task_yaml
from chorus.config import ChorusConfig
from chorus.engines.core.scoring import by_prompt_logprobs, split_text
from chorus.engines.transformers.engine import TransformersEngine
from tests.helpers import GEMMA, SMOL, LiveServer

pytestmark = pytest.mark.integration

# A slice in the formats of the shared sets (written for this test): PIQA-style and HellaSwag-style items.
ITEMS = [
    {"goal": "How do you keep bread fresh for longer?",
     "choices": ["Store it in a sealed bag in a cool, dry place.", "Leave it open on a sunny windowsill."], "label": 0},
    {"goal": "To cool a hot drink quickly,", "choices": ["pour it into a wide, cold glass.",
                                                         "wrap it in a thick wool blanket."], "label": 0},
    {"goal": "How can you find a small leak in a bicycle tube?",
     "choices": ["Submerge the inflated tube in water and look for bubbles.",
                 "Paint the tube red and wait for it to dry overnight."], "label": 0},
]
ENDINGS = {"context": "Baking a cake: A woman mixes flour and eggs in a large bowl. She",
           "choices": ["pours the batter into a round pan.", "throws the bowl out of the window.",
                       "reads a newspaper on the roof.", "then sings to the oven for an hour."], "label": 0}


def piqa_prompt(item: dict[str, Any]) -> str:
    return f"Question: {item['goal']}\nAnswer: "


def direct_logprobs(model_dir: Path, prompt: str, choices: list[str]) -> list[float]:
    """The reference: transformers on ``context + continuation`` (lm-eval's split), no chorus code."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ctx = prompt.rstrip()
    out = []
    for c in choices:
        ctx_ids = tok(ctx)["input_ids"]
        whole = tok(ctx + prompt[len(ctx):] + c)["input_ids"]
        with torch.inference_mode():
            lp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
        out.append(sum(float(lp[p - 1, whole[p]]) for p in range(len(ctx_ids), len(whole))))
    return out


@pytest.mark.parametrize("model", [SMOL, GEMMA])
def test_choices_equal_transformers_directly(real_server: LiveServer, default_config: ChorusConfig,
                                             model: str) -> None:
    prompt, choices = ENDINGS["context"] + " ", ENDINGS["choices"]
    r = httpx.post(real_server.url + "/v1/choices", json={"model": model, "prompt": prompt, "choices": choices},
                   timeout=300)
    assert r.status_code == 200, r.text
    got = [c["logprob"] for c in r.json()["choices"]]
    want = direct_logprobs(default_config.model(model).checkpoint_dir(), prompt, choices)
    assert got == pytest.approx(want, abs=1e-4)


async def test_the_shared_prefix_equals_a_whole_forward_per_choice(smol_engine: TransformersEngine) -> None:
    split = split_text(smol_engine.tokenizer, ENDINGS["context"] + " ", ENDINGS["choices"])
    fast = await smol_engine.score_continuations(split.prefix, split.choices)
    whole = await by_prompt_logprobs(smol_engine, split.prefix, split.choices)
    for f, w in zip(fast, whole):
        assert f == pytest.approx(w, abs=1e-4)
    assert smol_engine.active_sessions == 0


async def test_a_repeated_prefix_is_read_from_the_prefix_cache(smol_engine: TransformersEngine) -> None:
    """The second question with the same context (a few-shot preamble, a passage) reads it from the prefix cache:
    only the rest and the choices are computed, and the scores equal the cold ones."""
    await smol_engine.drop_prefix_cache()
    context = "The following are questions about the physical world. " * 4 + ENDINGS["context"] + " "
    split = split_text(smol_engine.tokenizer, context, ENDINGS["choices"])
    store = smol_engine.runner.prefix
    hits = store.hits
    cold = await smol_engine.score_continuations(split.prefix, split.choices)
    assert store.hits == hits and store.held_tokens == len(split.prefix)
    warm = await smol_engine.score_continuations(split.prefix, split.choices)
    assert store.hits == hits + 1 and store.hit_tokens >= len(split.prefix) - 1
    for w, c in zip(warm, cold):
        assert w == pytest.approx(c, abs=1e-4)
    await smol_engine.drop_prefix_cache()


def test_lm_eval_through_chorus_gives_the_same_loglikelihoods(real_server: LiveServer, default_config: ChorusConfig,
                                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the dev and eval extras")
    from lm_eval.tasks import TaskManager

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    data = tmp_path / "slice.jsonl"
    data.write_text("".join(json.dumps(it) + "\n" for it in ITEMS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "slice.yaml").write_text(
        task_yaml("chorus_slice", data, "validation", "Question: {{goal}}\nAnswer:"))
    model_dir = default_config.model(SMOL).checkpoint_dir()
    results = lm_eval.simple_evaluate(
        model="local-completions",
        tasks=["chorus_slice"],
        task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
        model_args=f"model={SMOL},base_url={real_server.url}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={model_dir},num_concurrent=1,max_retries=1",
        log_samples=True,
        bootstrap_iters=0,
    )
    samples = sorted(results["samples"]["chorus_slice"], key=lambda s: s["doc_id"])
    assert len(samples) == len(ITEMS)
    for sample, item in zip(samples, ITEMS):
        harness = [float(r[0][0]) for r in sample["resps"]]
        r = httpx.post(real_server.url + "/v1/choices", timeout=300,
                       json={"model": SMOL, "prompt": piqa_prompt(item), "choices": item["choices"]})
        ours = [c["logprob"] for c in r.json()["choices"]]
        direct = direct_logprobs(model_dir, piqa_prompt(item), item["choices"])
        assert harness == pytest.approx(ours, abs=1e-4) and ours == pytest.approx(direct, abs=1e-4)
        assert all(math.isfinite(x) for x in harness)
