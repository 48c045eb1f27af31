"""What the gateway holds for every request: the typed state of one app (``app.state.services``).

Everything that outlives a request lives here (and in the modules it names): the config, the engines and named
ensembles (filled at start-up), the keys and their counters, the feedback book, stored responses, held token
sessions, and the requests in flight. Routes reach it through their request's `Context` (gateway/context.py),
never through ``app.state`` attributes of their own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.types import ASGIApp

from chorus.config import ChorusConfig
from chorus.engines.core.base import Engine
from chorus.ensembles.base import Ensemble
from chorus.server.gateway.auth import KeyStore
from chorus.server.gateway.feedback_store import RequestBook
from chorus.server.gateway.held_sessions import SessionStore
from chorus.server.gateway.key_state import KeyState
from chorus.server.gateway.stored_responses import ResponseStore


class Admission:
    """Requests in flight, and draining on shutdown: shared by the front door (gateway/admission.py) and
    ``chorus serve``'s graceful stop."""

    def __init__(self) -> None:
        self.inflight = 0
        self.draining = False
        self.by_key: dict[str, int] = {}  #: requests in flight per key (its share of the limit)

    def take(self, key: str | None) -> None:
        self.inflight += 1
        if key is not None:
            self.by_key[key] = self.by_key.get(key, 0) + 1

    def give_back(self, key: str | None) -> None:
        self.inflight -= 1
        if key is not None:
            left = self.by_key.get(key, 1) - 1
            if left > 0:
                self.by_key[key] = left
            else:
                self.by_key.pop(key, None)

    def fair_share(self, key: str, limit: int) -> int | None:
        """Under contention (half the limit or more in flight), a key may hold at most ``limit / (k + 1)``
        requests, ``k`` the keys with work in flight, itself included: room is always left for one more tenant,
        and no key can take the whole server. Below contention: None (no share applies)."""
        if self.inflight < limit // 2:
            return None
        active = len(self.by_key) + (key not in self.by_key)
        return max(1, limit // (active + 1))


class BatchService(Protocol):
    """What the app's lifespan asks of the Batch API (server/batch/runner.py's `Batches`; the API routes get the
    class itself through `batches_of`)."""

    async def start(self, app: Any) -> None: ...

    async def stop(self) -> None: ...


@dataclass
class Services:
    config: ChorusConfig
    keys: KeyStore
    key_state: KeyState
    feedback: RequestBook
    responses: ResponseStore
    sessions: SessionStore
    admin_sha256: str | None = None  #: the admin API's key hash (None: no admin API)
    admission: Admission = field(default_factory=Admission)
    started: int = field(default_factory=lambda: int(time.time()))
    engines: dict[str, Engine] = field(default_factory=dict)  #: loaded at start-up
    ensembles: dict[str, Ensemble] = field(default_factory=dict)  #: built at start-up
    batches: BatchService | None = None  #: the Batch API (server/batch/runner.py's `Batches`; None: off)


def services_of(app: ASGIApp) -> Services:
    """The app's services (set by the app factory, server/app.py)."""
    services = app.state.services  # type: ignore[attr-defined]
    assert isinstance(services, Services)
    return services
