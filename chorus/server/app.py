"""The app factory: config -> engines (loaded at start-up) -> FastAPI app."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from chorus import __version__
from chorus.config import ChorusConfig, Settings
from chorus.engines.core.base import Engine
from chorus.engines.core.registry import build_engine, not_ready
from chorus.ensembles.base import Ensemble
from chorus.server import errors, tracing
from chorus.server.admin import router as admin_router
from chorus.server.auth import KeyStore, hash_key
from chorus.server.choices import router as choices_router
from chorus.server.embeddings import router as embeddings_router
from chorus.server.fastpath import FastPath
from chorus.server.feedback import router as feedback_router
from chorus.server.feedback_store import RequestBook, request_book
from chorus.server.gateway import Admission, Gateway
from chorus.server.key_state import KeyState, MemoryState
from chorus.server.limits import BodyLimit
from chorus.server.messages import router as messages_router
from chorus.server.metrics import watch_engines
from chorus.server.playground_route import router as playground_router
from chorus.server.responses import ResponseStore
from chorus.server.responses import router as responses_router
from chorus.server.routes import router
from chorus.server.sessions import SessionStore
from chorus.server.sessions import router as sessions_router
from chorus.server.sessions import router_v2 as sessions_router_v2

log = logging.getLogger("chorus.server")



def key_state(config: ChorusConfig) -> KeyState:
    """Where per-key windows, budgets and spend are counted (``server.state.store``)."""
    keys = {k.name: k for k in config.auth.keys}
    if config.server.state.store == "memory":
        return MemoryState(keys)
    from chorus.server.redis_state import RedisState

    return RedisState(config.server.state, keys)


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
        app.state.engines = loaded
        app.state.ensembles = {e.name: Ensemble.build(e, loaded) for e in served.ensembles}
        bind_learners(app.state.ensembles, app.state.feedback)
        for ensemble in app.state.ensembles.values():
            await ensemble.strategy.warm()
        app.state.sessions.start()
        await app.state.key_state.start()
        await app.state.feedback.start()
        unwatch = watch_engines(lambda: app.state.engines)
        try:
            yield
        finally:
            unwatch()
            await app.state.key_state.aclose()  # buffered charges are written before exit
            await app.state.feedback.aclose()  # and request records kept for feedback
            await app.state.sessions.stop()
            for engine in loaded.values():
                await engine.aclose()
            tracing.flush()

    traced = tracing.configure()  # OTEL_TRACES_EXPORTER and friends (server/tracing.py); off unless they say so
    otel: Any = None if config.server.opentelemetry or traced else {"tracing": False, "metrics": False, "logs": False}
    app = FastAPI(title="chorus", version=__version__, lifespan=lifespan, telemetry=otel,
                  description="OpenAI-compatible gateway with ensemble and routing backends")
    app.state.config = config
    app.state.started = int(time.time())
    app.state.engines = {}
    app.state.ensembles = {}
    app.state.responses = ResponseStore(config.server.limits.max_stored_responses)
    app.state.sessions = SessionStore(config.server.sessions.idle_timeout_s, config.server.sessions.max_open)
    errors.install(app)
    app.include_router(router)
    app.include_router(sessions_router)
    app.include_router(sessions_router_v2)
    app.include_router(choices_router)
    app.include_router(responses_router)
    app.include_router(messages_router)
    app.include_router(embeddings_router)
    app.include_router(feedback_router)
    app.include_router(admin_router)
    app.include_router(playground_router)
    app.add_middleware(FastPath)  # inside the limits: the two completion routes skip FastAPI's routing
    app.add_middleware(BodyLimit, max_bytes=config.server.limits.max_body_bytes)
    keys = KeyStore(config.auth.keys, api_keys if api_keys is not None else Settings().api_keys)
    app.state.keys = keys
    admin_key = Settings().admin_key
    app.state.admin_sha256 = hash_key(admin_key) if admin_key else config.server.state.admin_sha256
    app.state.admission = Admission()
    app.state.key_state = key_state(config)
    app.state.feedback = request_book(config.server.feedback, config.server.state)
    app.add_middleware(Gateway, keys=keys, limits=config.server.limits, admission=app.state.admission,
                       state=app.state.key_state, share=config.server.prefix_cache.share)  # outermost
    return app
