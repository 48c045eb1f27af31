"""What tests share (imported from here; conftest files hold only fixtures): a real uvicorn server on
127.0.0.1 in a background thread, one way to start a gateway over given engines, the fake-engine config,
waiting for a condition, and finding or requiring prepared models."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI

from chorus.config import ChorusConfig
from chorus.engines.core.base import Engine
from chorus.engines.core.spec import chorus_home
from chorus.server.app import create_app

SMOL = "smollm2-135m-instruct"
GEMMA = "gemma-3-270m"
QWEN = "qwen2.5-coder-0.5b-instruct"  #: the default chat model


class LiveServer:
    """Runs an app under uvicorn on an ephemeral 127.0.0.1 port until ``stop()``."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("live server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


@contextmanager
def gateway(config: ChorusConfig | dict[str, Any], engines: dict[str, Engine] | None = None, *,
            timeout: float = 120.0, **app_options: Any) -> Iterator[LiveServer]:
    """A live gateway: ``create_app(config, engines=..., **app_options)`` behind uvicorn, stopped on exit.
    ``engines``: prebuilt engines by model name (the others are loaded from the config)."""
    cfg = config if isinstance(config, ChorusConfig) else ChorusConfig.model_validate(config)
    own = None
    if cfg.server.batches.dir is None:  # a Batch API store of its own: apps sharing one would run each other's lines
        cfg = cfg.model_copy(deep=True)
        cfg.server.batches.dir = own = tempfile.mkdtemp(prefix="chorus-test-batches-")
    kwargs = {"engines": dict(engines)} if engines is not None else {}
    try:
        srv = LiveServer(create_app(cfg, **kwargs, **app_options)).start(timeout=timeout)
        try:
            yield srv
        finally:
            srv.stop()
    finally:
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)


def serve_fakes(engines: dict[str, Engine],
                ensembles: list[dict[str, Any]] | None = None) -> AbstractContextManager[LiveServer]:
    """A live gateway over these fake engines (each a config model of the same name) and named ensembles."""
    config = ChorusConfig.model_validate({"models": [{"name": n, "engine": "fake"} for n in engines],
                                         "ensembles": ensembles or []})
    return gateway(config, engines)


def fake_config(max_body_bytes: int = 64 * 1024) -> ChorusConfig:
    return ChorusConfig.model_validate({
        "server": {"limits": {"max_body_bytes": max_body_bytes, "max_n": 8}},
        "models": [{"name": "fake", "engine": "fake"}, {"name": "scripted", "engine": "fake"},
                   {"name": "slow", "engine": "fake"}, {"name": "broken", "engine": "fake"}],
    })


def wait_until(pred, timeout: float = 10.0, interval: float = 0.05) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


async def drained(engine) -> bool:  # type: ignore[no-untyped-def]
    """A batching engine with no session open and no row left (within 5 s): a closed session's row leaves the
    batch at the scheduler's next iteration, a moment after the request that closed it has returned."""
    for _ in range(500):
        if engine.active_sessions == 0 and not engine.runner.rows:
            return True
        await asyncio.sleep(0.01)
    return False


def require(ok: bool, reason: str) -> None:
    """Skip the test unless ``ok``; under ``CI=true`` fail instead: CI installs and prepares everything the suite
    needs, so a missing part there is a broken set-up, not a reason to skip."""
    if ok:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: a test that needs it must run there, not skip)")
    pytest.skip(reason)


def prepared_model_dir(name: str) -> Path:
    """A prepared default model's checkpoint, found through ``$CHORUS_HOME`` (`chorus_home`)."""
    d = chorus_home() / "models" / name
    require((d / "tokenizer.json").is_file(), f"needs the prepared {name} in {d} (make test prepares it)")
    return d
