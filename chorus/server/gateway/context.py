"""The typed per-request context: one `Context` per HTTP request, opened by the front door (gateway/admission.py)
before any route runs, and handed to routes by FastAPI's dependency `context` (the one reader of the ASGI
scope's state). It holds what admission established (the key, its counters, the deadline), what the route
resolved (`Served`, from server/resolve.py), and the app's `Services`; the replies, the accounting, the
streaming deadline and the access log all read this one object.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends
from starlette.requests import Request

from chorus.config import ChorusConfig
from chorus.engines.core.request_scope import UNSCOPED, RequestScope
from chorus.server.gateway.auth import Principal
from chorus.server.gateway.services import Services

STATE_KEY = "chorus.context"  #: where the front door leaves the context in the ASGI scope's state
#: the ASGI scope key naming the key a batch line runs as (server/batch/runner.py calls the app in-process with
#: it; a client cannot set an ASGI scope key, only headers, so it cannot pose as a batch)
BATCH_OWNER = "chorus.batch_owner"
ROUTE_KEY = "chorus.route"  #: the route template of a request served outside FastAPI's routing (the fast path)


@dataclass
class Served:
    """What one request is served by, as resolved for its key (server/resolve.py)."""

    model: str  #: the name answered under: a model, a named ensemble, or ``ensemble:STRATEGY`` for an inline one
    strategy: str = ""  #: the ensemble's strategy ("" for one model)
    prompt: Any = None  #: the prompt, for the access log (``server.log.prompts``), else None
    usage: dict[str, int] = field(default_factory=dict)  #: tokens used, once settled
    #: an ensemble's usage per member model (the key is charged per model it used), read when it is settled
    member_usage: Callable[[], dict[str, tuple[int, int]]] | None = None
    #: what an online router decided for it (kept for feedback, api/extensions/feedback.py), read when it is settled
    decision: Callable[[], dict[str, Any] | None] | None = None


@dataclass
class Context:
    services: Services
    request_id: str
    started: float  #: perf_counter at arrival (TTFT, the access log's ms)
    principal: Principal | None = None  #: the authenticated key (None without keys, or before authentication)
    admission_id: str = ""  #: the key-state store's id for this request's counts (never the client's id)
    counted_in: Any = None  #: the window the store counted it in (released at the end)
    deadline: float | None = None  #: loop time after which the work is cancelled (``request_timeout_s``)
    timeout: float | None = None  #: the deadline's length in seconds (for its error message)
    served: Served | None = None  #: set by resolve
    reservation: Any = None  #: the worst case held against the key's budget and tpm (server/reserve.py)
    http: Request | None = None  #: the HTTP request (its disconnect is watched), bound by `context`
    #: the prefix caches' tenant for the key (server/gateway/tenancy.py), set by the front door before any route
    tenant: str | None = None
    #: batch work (a Batch API line): set by the front door for the runner's own calls
    background: bool = False
    #: what the request hands the engines (`request_scope`), set by resolve
    scope: RequestScope = UNSCOPED
    #: what groups the sessions this request holds open (one object per request)
    group: object = field(default_factory=object)

    @property
    def config(self) -> ChorusConfig:
        return self.services.config

    @property
    def owner(self) -> str | None:
        """The name of the request's key (None without keys): what owns its stored responses and held sessions."""
        return self.principal.name if self.principal is not None else None

    def request_scope(self, body: Any = None) -> RequestScope:
        """What this request carries to the engines: the key's tenant, the body's ``cache_salt`` (which only
        narrows it) and ``user`` (a remote model's session routing), batch work (the front door's mark, or a body
        with ``priority`` > 0, sent by a gateway's remote engine), the deadline and the request id."""
        return RequestScope(tenant=self.tenant, salt=getattr(body, "cache_salt", None),
                            affinity=getattr(body, "user", None),
                            background=self.background or getattr(body, "priority", 0) > 0,
                            deadline=self.deadline, request_id=self.request_id, group=self.group)

    def resolved(self) -> Served:
        """What resolve recorded; a request that reaches a reply without it is a bug, never served unchecked."""
        if self.served is None:
            path = self.http.url.path if self.http is not None else "?"
            raise RuntimeError(f"{path}: the route replied without resolving its model (server/resolve.py)")
        return self.served


def context(request: Request) -> Context:
    """FastAPI's dependency for a route's context (`Depends(context)`); the completion fast path calls it too."""
    ctx = request.scope["state"][STATE_KEY]
    assert isinstance(ctx, Context)
    ctx.http = request
    return ctx


#: a route's parameter for its context: ``ctx: Ctx`` (FastAPI's dependency, as an annotation)
Ctx = Annotated[Context, Depends(context)]
