"""The gateway's front door, one ASGI middleware around every request.

For every request: its `Context` (gateway/context.py, the one typed record every layer reads), a request id
(``X-Request-ID`` accepted if sane, else generated; echoed on the response), one structured access-log line, and
the request metrics. For ``/v1/*`` requests, before any
work: draining (503 during shutdown), the API key (401), the key's limits and budget (429 with ``Retry-After``;
counted in the ``server.state`` store: this process, or Redis shared by every replica),
the server-wide admission limit (503 ``server_overloaded`` with ``Retry-After``; no unbounded queue),
and the deadline (``request_timeout_s``, lowered per request by an ``X-Chorus-Timeout`` header); then the prefix
caches' tenant scope (server/gateway/tenancy.py) for everything the request runs.
Admission is released when the response's last byte is sent (streams included).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chorus.errors import (
    BodyTimeout,
    EngineUnavailable,
    GatewayError,
    InvalidRequest,
    Overloaded,
    PermissionDenied,
    RateLimited,
)
from chorus.server.gateway.auth import Principal
from chorus.server.gateway.context import BATCH_OWNER, ROUTE_KEY, STATE_KEY, Context
from chorus.server.gateway.errors import error_response, for_path
from chorus.server.gateway.metrics import INFLIGHT, LATENCY, REFUSED, REQUESTS
from chorus.server.gateway.services import Services
from chorus.server.gateway.tenancy import cache_scope, scope_secret

log = logging.getLogger("chorus.access")
_SANE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
#: paths a key reaches outside its request windows and budget when it reads, deletes or cancels (still
#: authenticated, still under the server's admission limit): the Batch API's bookkeeping, so a key whose budget
#: stopped its batch can still read what ran and stop it (the batch's lines are the requests, each admitted and
#: charged as a live one). An upload or a new batch is metered as any request (rpm, in flight, budget).
UNMETERED = ("/v1/files", "/v1/batches")
BODY_METHODS = ("POST", "PUT", "PATCH")  #: requests with a body: it is read before they count in flight


def metered(method: str | None, path: str) -> bool:
    """Whether the request counts against its key's windows and budget (`UNMETERED`)."""
    if not path.startswith(UNMETERED):
        return True
    return method in BODY_METHODS and not path.endswith("/cancel")


class Gateway:
    def __init__(self, app: ASGIApp, services: Services) -> None:
        self.app = app
        self.services = services
        self.keys = services.keys
        self.share = services.config.server.prefix_cache.share  # whose prefixes a request may reuse
        self.secret = scope_secret(p.sha256 for p in self.keys.principals)
        self.state = services.key_state
        self.limits = services.config.server.limits
        self.admission = services.admission
        #: uploads stream to disk as they come (multipart), under the request's deadline, not read here first
        self.uploads = {"/v1/files"}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        given = headers.get("x-request-id", "")
        rid = given if _SANE_ID.match(given) else uuid.uuid4().hex
        t0 = time.perf_counter()
        ctx = Context(self.services, rid, t0)
        scope.setdefault("state", {})[STATE_KEY] = ctx
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
                    principal = self.authenticate(headers, ctx, scope.get(BATCH_OWNER))
                    if scope.get("method") in BODY_METHODS and path not in self.uploads:
                        # the body is read before the request counts in flight: a slow sender holds no slot
                        receive = await read_body(receive, self.limits.max_body_bytes, self.limits.body_timeout_s)
                    await self.admit(headers, ctx, principal, metered=metered(scope.get("method"), path))
                    admitted = True
                    # the prefix caches' tenant (server/gateway/tenancy.py): set here, before any route, from the key
                    ctx.tenant = cache_scope(principal, self.share, self.secret)
                    if scope.get(BATCH_OWNER) is not None:  # a Batch API line: the engines queue it behind live work
                        ctx.background = True
                except GatewayError as exc:
                    if isinstance(exc, RateLimited):  # the allow-list answers before the limits and the budget
                        exc = await self.unlisted(ctx.principal, path, receive) or exc
                    REFUSED.labels(exc.code or exc.type).inc()
                    await for_path(path, error_response(exc))(scope, receive, send_with_id)
                    return
            await self.app(scope, receive, send_with_id)
        finally:
            if principal is not None and ctx.reservation is not None:  # never settled (failed, cancelled)
                self.state.unreserve(principal, ctx.reservation)
            if admitted:
                self.admission.give_back(principal.name if principal is not None else None)
                INFLIGHT.dec()
                if principal is not None and ctx.admission_id:
                    await self.state.release(principal, ctx.counted_in)
            elapsed = time.perf_counter() - t0
            route = route_label(scope)
            LATENCY.labels(route).observe(elapsed)
            served = ctx.served  # what the route resolved (server/resolve.py), if it got that far
            model, strategy = (served.model, served.strategy) if served is not None else ("", "")
            REQUESTS.labels(route, model, strategy, str(status["code"])).inc()
            log.info("request", extra={"request_id": rid, "method": scope.get("method"), "path": path,
                                       "status": status["code"], "ms": round(elapsed * 1000, 1),
                                       "key": principal.name if principal else None, "model": model or None,
                                       "strategy": strategy or None,
                                       "usage": served.usage or None if served is not None else None,
                                       **({"prompt": served.prompt} if served is not None
                                          and served.prompt is not None else {})})

    def authenticate(self, headers: dict[str, str], ctx: Context, batch_owner: str | None = None
                     ) -> Principal | None:
        """The request's key (None when the server has no keys); draining refuses before anything is read."""
        if self.admission.draining:
            raise EngineUnavailable("The server is shutting down; retry on another replica.", code="draining")
        if batch_owner is not None:  # a batch's line, sent in-process by the batch runner as its key
            principal = self.keys.named(batch_owner) if self.keys.enabled else None
        else:  # Anthropic's clients send the key as x-api-key
            given = headers.get("authorization") or (f"Bearer {headers['x-api-key']}" if "x-api-key" in headers
                                                     else None)
            principal = self.keys.authenticate(given) if self.keys.enabled else None
        ctx.principal = principal  # known from here on (the allow-list may answer a refusal below)
        return principal

    async def admit(self, headers: dict[str, str], ctx: Context, principal: Principal | None,
                    metered: bool = True) -> None:
        """Count the request in flight (the server's limit, the key's fair share of it, the key's own limits and
        budget) and set its deadline."""
        limit = self.limits.max_concurrent_requests
        if self.admission.inflight >= limit:
            raise Overloaded(f"The server is at its limit of {limit} requests in flight; retry shortly.",
                             retry_after=1.0)
        if principal is not None:
            share = self.admission.fair_share(principal.name, limit)
            held = self.admission.by_key.get(principal.name, 0)
            if share is not None and held >= share:
                raise RateLimited(f"Key {principal.name!r} holds {held} of the server's {limit} request slots, its "
                                  f"fair share while the server is busy; retry shortly.", retry_after=1.0,
                                  code="fair_share_exceeded")
        if principal is not None and metered:
            # the store's own id (never the client's X-Request-ID: a reused one must not merge two requests' counts)
            ctx.admission_id = uuid.uuid4().hex
            ctx.counted_in = await self.state.admit(principal, ctx.admission_id)
        timeout = self.limits.request_timeout_s
        if "x-chorus-timeout" in headers:
            try:
                asked = float(headers["x-chorus-timeout"])
            except ValueError:
                asked = -1.0
            if not asked > 0:
                if principal is not None and ctx.admission_id:
                    await self.state.release(principal, ctx.counted_in)
                raise InvalidRequest("X-Chorus-Timeout must be a positive number of seconds.", param="X-Chorus-Timeout")
            timeout = min(timeout, asked)
        ctx.deadline = asyncio.get_running_loop().time() + timeout
        ctx.timeout = timeout
        self.admission.take(principal.name if principal is not None else None)
        INFLIGHT.inc()

    async def unlisted(self, principal: Principal | None, path: str, receive: Receive) -> PermissionDenied | None:
        """A key over its limits or budget that asks for a model its allow-list refuses gets the allow-list's 403,
        as it would under its limits (the 403 tells it nothing it does not know; a 429 would say the model
        exists and only the budget stands in the way). The model is read from the path (``/v1/models/{id}``) or
        the JSON body's ``model`` and inline ``ensemble`` members; the body is read only on this refusal path."""
        if principal is None or principal.models is None:
            return None
        names: list[str] = []
        if path.startswith("/v1/models/"):
            names.append(path.removeprefix("/v1/models/"))
        else:
            names.extend(await requested_models(receive, self.limits.max_body_bytes))
        try:
            principal.authorize(names)
        except PermissionDenied as exc:
            return exc
        return None


def route_label(scope: Scope) -> str:
    """The metrics' route label: the route's template (``/v1/files/{file_id}``), never the raw path (ids stay out
    of /metrics and a client cannot grow it with paths of its own); a path no route matches is ``unmatched``."""
    route = scope.get("route")
    template = scope.get(ROUTE_KEY) or getattr(route, "path_format", None) or getattr(route, "path", None)
    return template if isinstance(template, str) else "unmatched"


async def read_body(receive: Receive, max_bytes: int, timeout_s: float) -> Receive:
    """Read the request's body (up to one message past ``max_bytes``: the body limit inside answers the 413)
    within ``timeout_s`` (`BodyTimeout` after), and return a ``receive`` that replays it, then waits on the
    client as before (a disconnect still arrives)."""
    messages: list[Message] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                message = await receive()
                messages.append(message)
                if message["type"] != "http.request":
                    break
                size += len(message.get("body", b""))
                if size > max_bytes or not message.get("more_body", False):
                    break
    except TimeoutError:
        raise BodyTimeout(f"The request body did not arrive within {timeout_s:g} s "
                          "(server.limits.body_timeout_s).") from None
    replay = iter(messages)

    async def replayed() -> Message:
        for message in replay:
            return message
        return await receive()

    return replayed


async def requested_models(receive: Receive, max_bytes: int) -> list[str]:
    """The model names a JSON request body asks for (``model``, an inline ensemble's members); [] when it is not
    JSON or is larger than ``max_bytes``."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return []
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > max_bytes:
            return []
        if not message.get("more_body", False):
            break
    try:
        body = json.loads(b"".join(chunks) or b"{}")
    except ValueError:
        return []
    if not isinstance(body, dict):
        return []
    names = [body["model"]] if isinstance(body.get("model"), str) else []
    ensemble = body.get("ensemble")
    named: list[Any] = []
    if isinstance(ensemble, dict):
        named += listed(ensemble.get("members"))
        named.append(ensemble.get("aggregator"))
    for plugin in listed(body.get("plugins")):
        if isinstance(plugin, dict):  # the fusion plugin's panel and judge
            named += listed(plugin.get("analysis_models"))
            named.append(plugin.get("model"))
    for m in named:
        name = m if isinstance(m, str) else m.get("model") if isinstance(m, dict) else None
        if isinstance(name, str):
            names.append(name)
    return names


def listed(value: Any) -> list[Any]:
    """``value`` if it is a list, else none (a body's field of the wrong type names no model)."""
    return value if isinstance(value, list) else []
