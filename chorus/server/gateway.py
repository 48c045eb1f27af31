"""The gateway's front admission, one ASGI middleware around every request.

For every request: a request id (``X-Request-ID`` accepted if sane, else generated; echoed on the
response), one structured access-log line, and the request metrics. For ``/v1/*`` requests, before any
work: draining (503 during shutdown), the API key (401), the key's limits and budget (429 with ``Retry-After``;
counted in the ``server.state`` store: this process, or Redis shared by every replica),
the server-wide admission limit (503 ``server_overloaded`` with ``Retry-After``; no unbounded queue),
and the deadline (``request_timeout_s``, lowered per request by an ``X-Chorus-Timeout`` header).
Admission is released when the response's last byte is sent (streams included).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chorus.config import Limits
from chorus.engines.core.base import REQUEST_SCOPE
from chorus.ensembles.spans import REQUEST_ID
from chorus.errors import EngineUnavailable, GatewayError, InvalidRequest, Overloaded
from chorus.server.auth import KeyStore, Principal
from chorus.server.errors import error_response, for_path
from chorus.server.key_state import KeyState, MemoryState
from chorus.server.metrics import INFLIGHT, LATENCY, REFUSED, REQUESTS
from chorus.server.resolve import Served

log = logging.getLogger("chorus.access")
_SANE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class Admission:
    """State shared by the middleware and the app: requests in flight, and draining on shutdown."""

    def __init__(self) -> None:
        self.inflight = 0
        self.draining = False


class Gateway:
    def __init__(self, app: ASGIApp, keys: KeyStore, limits: Limits, admission: Admission,
                 state: KeyState | None = None) -> None:
        self.app = app
        self.keys = keys
        self.state = state or MemoryState({})
        self.limits = limits
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        REQUEST_SCOPE.set(object())  # this request's own (uvicorn runs each request in a task of its own)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        given = headers.get("x-request-id", "")
        rid = given if _SANE_ID.match(given) else uuid.uuid4().hex
        state: dict[str, Any] = scope.setdefault("state", {})
        state["request_id"] = rid
        REQUEST_ID.set(rid)  # on every span of this request (ensembles/spans.py)
        t0 = state["started"] = time.perf_counter()
        status = {"code": 0}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", rid.encode())]
            await send(message)

        path = scope.get("path", "")
        principal: Principal | None = None
        admitted = False
        try:
            if path.startswith(("/v1/", "/chorus/")):  # the OpenAI API and the session API
                try:
                    principal = await self.admit(headers, state)
                    admitted = True
                except GatewayError as exc:
                    REFUSED.labels(exc.code or exc.type).inc()
                    await for_path(path, error_response(exc))(scope, receive, send_with_id)
                    return
            await self.app(scope, receive, send_with_id)
        finally:
            if admitted:
                self.admission.inflight -= 1
                INFLIGHT.dec()
                if principal is not None:
                    await self.state.release(principal, state["counted_in"])
            elapsed = time.perf_counter() - t0
            route = path if not path.startswith("/v1/models/") else "/v1/models/{id}"
            LATENCY.labels(route).observe(elapsed)
            served = state.get("served")  # what the route resolved (server/resolve.py), if it got that far
            model, strategy = (served.model, served.strategy) if isinstance(served, Served) else ("", "")
            REQUESTS.labels(route, model, strategy, str(status["code"])).inc()
            log.info("request", extra={"request_id": rid, "method": scope.get("method"), "path": path,
                                       "status": status["code"], "ms": round(elapsed * 1000, 1),
                                       "key": principal.name if principal else None, "model": model or None,
                                       "strategy": strategy or None,
                                       "usage": served.usage or None if isinstance(served, Served) else None,
                                       **({"prompt": served.prompt} if isinstance(served, Served)
                                          and served.prompt is not None else {})})

    async def admit(self, headers: dict[str, str], state: dict[str, Any]) -> Principal | None:
        if self.admission.draining:
            raise EngineUnavailable("The server is shutting down; retry on another replica.", code="draining")
        # Anthropic's clients send the key as x-api-key
        given = headers.get("authorization") or (f"Bearer {headers['x-api-key']}" if "x-api-key" in headers else None)
        principal = self.keys.authenticate(given) if self.keys.enabled else None
        if self.admission.inflight >= self.limits.max_concurrent_requests:
            raise Overloaded(f"The server is at its limit of {self.limits.max_concurrent_requests} requests in "
                             "flight; retry shortly.", retry_after=1.0)
        if principal is not None:
            # the store's own id (never the client's X-Request-ID: a reused one must not merge two requests' counts)
            state["admission_id"] = uuid.uuid4().hex
            state["counted_in"] = await self.state.admit(principal, state["admission_id"])
        timeout = self.limits.request_timeout_s
        if "x-chorus-timeout" in headers:
            try:
                asked = float(headers["x-chorus-timeout"])
            except ValueError:
                asked = -1.0
            if not asked > 0:
                if principal is not None:
                    await self.state.release(principal, state["counted_in"])
                raise InvalidRequest("X-Chorus-Timeout must be a positive number of seconds.", param="X-Chorus-Timeout")
            timeout = min(timeout, asked)
        state["principal"] = principal
        state["deadline"] = asyncio.get_running_loop().time() + timeout
        state["timeout"] = timeout
        self.admission.inflight += 1
        INFLIGHT.inc()
        return principal
