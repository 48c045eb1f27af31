"""Unit fixtures: the gateway over fake engines, behind a real HTTP server, with the openai SDK."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from chorus.engines.fake import FakeEngine
from tests.helpers import LiveServer, fake_config, gateway


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
