"""Unit fixtures: the gateway over fake engines, behind a real HTTP server, with the openai SDK."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import openai
import pytest

from chorus.config import ChorusConfig
from chorus.engines.fake import FakeEngine
from chorus.server.app import create_app
from tests.conftest import LiveServer


def fake_config(max_body_bytes: int = 64 * 1024) -> ChorusConfig:
    return ChorusConfig.model_validate({
        "server": {"limits": {"max_body_bytes": max_body_bytes, "max_n": 8}},
        "models": [{"name": "fake", "engine": "fake"}, {"name": "scripted", "engine": "fake"},
                   {"name": "slow", "engine": "fake"}, {"name": "broken", "engine": "fake"}],
    })


@contextmanager
def serve_fakes(engines: dict[str, FakeEngine], ensembles: list[dict[str, Any]] | None = None) -> Iterator[LiveServer]:
    """A live gateway over these fake engines (each a config model of the same name) and named ensembles."""
    cfg = ChorusConfig.model_validate({"models": [{"name": n, "engine": "fake"} for n in engines],
                                       "ensembles": ensembles or []})
    srv = LiveServer(create_app(cfg, engines=dict(engines))).start()
    try:
        yield srv
    finally:
        srv.stop()


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
    srv = LiveServer(create_app(fake_config(), engines=dict(fakes))).start()
    yield srv
    srv.stop()


@pytest.fixture
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
