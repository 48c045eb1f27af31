"""The app factory: config -> engines (loaded at start-up) -> FastAPI app."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from chorus import __version__
from chorus.config import ChorusConfig, Settings
from chorus.engines.core.base import Engine
from chorus.engines.core.home import chorus_home
from chorus.engines.core.registry import build_engine, not_ready
from chorus.ensembles.base import Ensemble
from chorus.lazy import load
from chorus.server.api.openai.batches import ENDPOINTS
from chorus.server.api.openai.fastpath import FastPath
from chorus.server.batch.runner import Batches
from chorus.server.gateway import errors, tracing
from chorus.server.gateway.admission import Gateway
from chorus.server.gateway.auth import KeyStore, hash_key
from chorus.server.gateway.feedback_store import RequestBook, request_book
from chorus.server.gateway.held_sessions import SessionStore
from chorus.server.gateway.key_state import KeyState, MemoryState
from chorus.server.gateway.limits import BodyLimit
from chorus.server.gateway.metrics import watch_engines
from chorus.server.gateway.services import Services
from chorus.server.gateway.stored_responses import ResponseStore

log = logging.getLogger("chorus.server")

#: every API surface's routes (server/api/), as "module:router" (the registries' convention): a new surface is its
#: own module and one line here
SURFACES = (
    # OpenAI's
    "chorus.server.api.openai.models:router",
    "chorus.server.api.openai.routes:router",  # chat and completions
    "chorus.server.api.openai.embeddings:router",
    "chorus.server.api.openai.files:router",
    "chorus.server.api.openai.batches:router",
    "chorus.server.api.openai.responses.routes:router",
    # Anthropic's
    "chorus.server.api.anthropic.routes:router",
    # chorus's own
    "chorus.server.api.extensions.ops:router",  # /health, /metrics
    "chorus.server.api.extensions.choices:router",
    "chorus.server.api.extensions.feedback:router",
    "chorus.server.api.extensions.sessions:router",
    "chorus.server.api.extensions.sessions:router_v2",
    "chorus.server.api.extensions.admin:router",
    "chorus.server.api.extensions.playground.routes:router",
)

def key_state(config: ChorusConfig) -> KeyState:
    """Where per-key windows, budgets and spend are counted (``server.state.store``)."""
    keys = {k.name: k for k in config.auth.keys}
    if config.server.state.store == "memory":
        return MemoryState(keys)
    from chorus.server.gateway.redis_state import RedisState

    return RedisState(config.server.state, keys)


def batch_dir(config: ChorusConfig) -> Path:
    """Where the Batch API keeps its files and jobs: the config's ``server.batches.dir``, else
    ``$CHORUS_BATCH_DIR``, else ``$CHORUS_HOME/batches``."""
    given = config.server.batches.dir or Settings().batch_dir
    return Path(given).expanduser() if given else chorus_home() / "batches"


def bind_learners(named: dict[str, Ensemble], book: RequestBook) -> None:
    """Named ensembles that learn from feedback (online routers) get the served ensembles (their arms) and the
    shared outcome log (the config has checked the arms and metrics they name)."""
    for ensemble in named.values():
        ensemble.strategy.bind(named, book.outcomes)


def create_app(config: ChorusConfig, engines: dict[str, Engine] | None = None, api_keys: str | None = None) -> FastAPI:
    """Build the gateway. ``engines`` injects ready engines (tests); otherwise each model is loaded at start-up."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loaded = dict(engines) if engines is not None else {}
        served = config
        if engines is None:  # what is prepared (chorus serve has already left the rest out and said so)
            served, skipped = config.served(not_ready)
            for line in skipped:
                log.info(line)
            for spec in served.models:
                t0 = time.perf_counter()
                loaded[spec.name] = build_engine(spec, {m.name: m for m in config.models})
                log.info("model %s ready in %.1fs", spec.name, time.perf_counter() - t0)
        for engine in loaded.values():
            await engine.start()
        services.engines = loaded
        services.ensembles = {e.name: Ensemble.build(e, loaded) for e in served.ensembles}
        bind_learners(services.ensembles, services.feedback)
        for ensemble in services.ensembles.values():
            await ensemble.strategy.warm()
        services.sessions.start()
        await services.key_state.start()
        await services.feedback.start()
        unwatch = watch_engines(lambda: services.engines)
        if services.batches is not None:
            await services.batches.start(app)  # resumes the unfinished batches of an earlier run
        try:
            yield
        finally:
            unwatch()
            if services.batches is not None:
                await services.batches.stop()  # lines in flight given back, run again at the next start
            await services.key_state.aclose()  # buffered charges are written before exit
            await services.feedback.aclose()  # and request records kept for feedback
            await services.sessions.stop()
            for engine in loaded.values():
                await engine.aclose()
            tracing.flush()

    traced = tracing.configure()  # OTEL_TRACES_EXPORTER and friends (server/gateway/tracing.py); off unless they say so
    otel: Any = None if config.server.opentelemetry or traced else {"tracing": False, "metrics": False, "logs": False}
    app = FastAPI(title="chorus", version=__version__, lifespan=lifespan, telemetry=otel,
                  description="OpenAI-compatible gateway with ensemble and routing backends")
    admin_key = Settings().admin_key
    services = Services(
        config=config,
        keys=KeyStore(config.auth.keys, api_keys if api_keys is not None else Settings().api_keys),
        key_state=key_state(config),
        feedback=request_book(config.server.feedback, config.server.state),
        responses=ResponseStore(config.server.limits.max_stored_responses),
        sessions=SessionStore(config.server.sessions.idle_timeout_s, config.server.sessions.max_open,
                              config.server.sessions.max_per_key),
        admin_sha256=hash_key(admin_key) if admin_key else config.server.state.admin_sha256,
    )
    if config.server.batches.enabled:
        services.batches = Batches(batch_dir(config), config.server.batches, services, ENDPOINTS)
    app.state.services = services  # the one thing the app holds (gateway/services.py)
    errors.install(app)
    for router in SURFACES:
        app.include_router(load(router))
    app.add_middleware(FastPath)  # inside the limits: the two completion routes skip FastAPI's routing
    uploads = {"/v1/files": config.server.batches.max_file_bytes} if config.server.batches.enabled else {}
    app.add_middleware(BodyLimit, max_bytes=config.server.limits.max_body_bytes, paths=uploads)
    app.add_middleware(Gateway, services=services)  # outermost: every request's context, key and limits
    return app
