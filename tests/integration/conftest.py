"""Integration fixtures: the real default models, prepared once, behind one live server per session."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import openai
import pytest
import torch

from chorus.config import ChorusConfig, load_config
from chorus.engines.core.registry import prepare_model
from chorus.engines.transformers.engine import TransformersEngine
from tests.helpers import GEMMA, SMOL, LiveServer, gateway

# served in bfloat16 by default (memory); the tests compare them with float32 references (a transformers forward,
# the dense SmolLM2 token for token, Gemma's sliding window), so they load them in float32 here
FLOAT32 = (GEMMA, "smollm2-moe")


@pytest.fixture(scope="session")
def default_config() -> ChorusConfig:
    torch.set_num_threads(2)
    config = load_config(None)
    config.models = [m for m in config.models if not m.optional]  # the opt-in Qwen models: tests that need them ask
    for spec in config.models:
        if spec.name in FLOAT32:
            spec.dtype = "float32"
    for spec in config.models:
        prepare_model(spec, models={m.name: m for m in config.models})  # idempotent: `make test` prepared them
    return config


@pytest.fixture(scope="session")
def real_server(default_config: ChorusConfig) -> Iterator[LiveServer]:
    with gateway(default_config, timeout=300) as srv:
        yield srv


@pytest.fixture
def sdk(real_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
async def smol_engine(default_config: ChorusConfig) -> AsyncIterator[TransformersEngine]:
    """A second, in-test-loop instance of smollm2 for engine-level equivalence tests."""
    engine = TransformersEngine.load(default_config.model(SMOL))
    await engine.start()
    yield engine
    await engine.aclose()
