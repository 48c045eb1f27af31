"""Unit fixtures: the gateway over fake engines, behind a real HTTP server, with the openai SDK; the tiny random
Llama bases the family tests (MoE, grafting, MoDr, ReasonFormer) share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from chorus.engines.fake.engine import FakeEngine
from chorus.engines.families.checkpoint import tiny_llama
from tests.helpers import LiveServer, fake_config, gateway, prepared_model_dir


@pytest.fixture(scope="module")
def fakes() -> dict[str, FakeEngine]:
    return {
        "fake": FakeEngine("fake", max_model_len=64),
        "scripted": FakeEngine("scripted", script="Hello there. STOP here."),
        "slow": FakeEngine("slow", delay=0.02, max_model_len=10_000),
        "broken": FakeEngine("broken", script="abcdefghijklmnop", fail_after=5),
    }


@pytest.fixture(scope="module")
def server(fakes: dict[str, FakeEngine]) -> Iterator[LiveServer]:
    with gateway(fake_config(), fakes) as srv:
        yield srv


@pytest.fixture
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random 5-layer Llama checkpoint (read only: builders write their outputs elsewhere)."""
    return tiny_llama(tmp_path_factory.mktemp("tiny") / "base", layers=5)


@pytest.fixture(scope="session")
def ids() -> torch.Tensor:
    """Two 13-token rows of the tiny base's vocabulary."""
    return torch.randint(3, 256, (2, 13), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def tokenized_base(tmp_path: Path) -> Path:
    """A tiny 5-layer Llama with SmolLM2's vocabulary and tokenizer, for the training loops (which read text)."""
    tok = prepared_model_dir("smollm2-135m-instruct")
    return tiny_llama(tmp_path / "tbase", layers=5, vocab=49152, tokenizer_from=tok)
