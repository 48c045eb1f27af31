"""The one step that resolves what a request is served by, for its key.

Every route that names a model calls one of the functions below exactly once, before any work: `model_for` (an
engine), `ensemble_for` (a named or inline ensemble) or `admit` (a model already resolved, such as a held token
session's). Each checks the key's allow-list (a named ensemble is one name; an inline ensemble is every model it
uses), and records a typed `Served` on the request: the name served, the strategy, the prompt for the access log
(only with ``server.log.prompts``), and later the usage. The replies, the accounting and the access log read it
through `served_of`, which refuses a request that skipped this step; and a test walks every route of the app to
check that each model-naming route refuses a model its key may not use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from chorus.engines.core.base import EMBEDDINGS, ChoiceScorer, Engine
from chorus.ensembles.base import Ensemble
from chorus.errors import CapabilityMismatch, ModelNotFound


@dataclass
class Served:
    """What one request is served by, as resolved for its key (``request.state.served``)."""

    model: str  #: the name answered under: a model, a named ensemble, or ``ensemble:STRATEGY`` for an inline one
    strategy: str = ""  #: the ensemble's strategy ("" for one model)
    prompt: Any = None  #: the prompt, for the access log (``server.log.prompts``), else None
    usage: dict[str, int] = field(default_factory=dict)  #: tokens used, once settled
    #: an ensemble's usage per member model (the key is charged per model it used), read when it is settled
    member_usage: Callable[[], dict[str, tuple[int, int]]] | None = None
    #: what an online router decided for it (kept for feedback, server/feedback.py), read when it is settled
    decision: Callable[[], dict[str, Any] | None] | None = None


def engines(request: Request) -> dict[str, Engine]:
    return request.app.state.engines


def ensembles(request: Request) -> dict[str, Ensemble]:
    return request.app.state.ensembles


def owner_of(request: Request) -> str | None:
    """The name of the request's key (None without keys): what owns its stored responses and held sessions."""
    principal = getattr(request.state, "principal", None)
    return principal.name if principal is not None else None


def visible(request: Request) -> list[str]:
    """The models and named ensembles the request's key may use, in the config's order: all of them without an
    allow-list. Listings and "not found" messages show only these (a key learns nothing of the others)."""
    principal = getattr(request.state, "principal", None)
    names = [*engines(request), *ensembles(request)]
    if principal is None or principal.models is None:
        return names
    return [n for n in names if n in principal.models]


def not_found(request: Request, name: str) -> ModelNotFound:
    known = ", ".join(sorted(visible(request))) or "none"
    return ModelNotFound(f"The model '{name}' does not exist. Available models: {known}.", param="model")


def lookup(request: Request, name: str) -> Engine:
    """The engine named ``name``, or a 404 listing what the key may use (no allow-list check: see `model_for`)."""
    found = engines(request).get(name)
    if found is None:
        raise not_found(request, name)
    return found


def admit(request: Request, model: str, strategy: str = "", uses: Iterable[str] = (), body: Any = None) -> Served:
    """Check the key may use ``model`` (and every model an inline ensemble ``uses``), and record what serves the
    request. The ``body``'s prompt is kept for the access log only when ``server.log.prompts`` is on."""
    principal = getattr(request.state, "principal", None)
    if principal is not None:
        principal.authorize([model, *uses])
    prompt = None
    if body is not None and request.app.state.config.server.log.prompts:
        prompt = body.message_dicts() if getattr(body, "messages", None) is not None else body.prompt
    served = Served(model, strategy, prompt)
    request.state.served = served
    return served


def model_for(request: Request, name: str, *, body: Any = None, generates: bool = False) -> Engine:
    """The engine serving ``name`` for this request's key; ``generates``: it must make text (chat, completions),
    so a scorer or an embedding model is a 400 saying what it does instead."""
    engine = lookup(request, name)
    admit(request, name, body=body)
    if generates:
        refuse = getattr(engine, "refuse", None)  # a model that generates nothing says what it does instead
        if EMBEDDINGS in engine.capabilities and refuse is not None:
            raise refuse("generate text")
        if isinstance(engine, ChoiceScorer):
            raise CapabilityMismatch(f"The model '{name}' is a multiple-choice scorer: it only scores choices "
                                     "(POST /v1/choices); it cannot generate text.", param="model")
    return engine


def ensemble_for(request: Request, name: str, ensemble: Ensemble, body: Any = None) -> Served:
    """Admit an ensemble: a named one (``name`` is one of the config's) is one name for the allow-list; an inline
    one (the body's ``ensemble``) is served as ``ensemble:STRATEGY`` and needs every model it uses."""
    named = name in ensembles(request)
    return admit(request, name if named else f"ensemble:{ensemble.spec.strategy}", ensemble.spec.strategy,
                 uses=() if named else ensemble.strategy.models(), body=body)


def served_of(request: Request) -> Served:
    """What `admit` recorded; a request that reaches a reply without it is a bug, never served unchecked."""
    served = getattr(request.state, "served", None)
    if not isinstance(served, Served):
        raise RuntimeError(f"{request.url.path}: the route replied without resolving its model (server/resolve.py)")
    return served
