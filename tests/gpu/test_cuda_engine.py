"""GPU checks, run on an accelerator machine (skipped where CUDA is absent)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from chorus.config import load_config
from chorus.engines.core.base import GenerationRequest, SamplingParams
from chorus.engines.core.registry import prepare_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_engine_on_cuda_batches_like_sequential(dtype: str) -> None:
    from chorus.engines.transformers.engine import TransformersEngine

    spec = load_config(None).model("smollm2-135m-instruct").model_copy(update={"device": "cuda", "dtype": dtype})
    prepare_model(spec)
    engine = TransformersEngine.load(spec)
    await engine.start()
    try:
        qs = ["What is the capital of France?", "Name a color.", "Count to three."]
        reqs = [GenerationRequest(engine.tokenizer.encode_chat([{"role": "user", "content": q}]),
                                  SamplingParams(temperature=0, max_tokens=16)) for q in qs]
        seq = [(await engine.generate(r)).choices[0].text for r in reqs]
        par = [g.choices[0].text for g in await asyncio.gather(*(engine.generate(r) for r in reqs))]
        assert "Paris" in seq[0]
        if dtype == "float32":
            assert par == seq
        assert engine.active_sessions == 0
    finally:
        await engine.aclose()
