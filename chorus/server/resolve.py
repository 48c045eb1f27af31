"""The one step that turns (key, request body) into what serves it: a typed `Target`.

Every route that names a model calls `resolve` (or, for a model already held, such as a token session's,
`admit`) exactly once, before any work. It finds the target: a model, a named ensemble, or the body's inline
``ensemble`` (merged over a named one when both are given); checks the key's allow-list (a named ensemble is one
name, and a body that overrides it is checked for every model it then reaches that the named one did not; an
inline one is the key's leave to compose and every model it reaches: members, aggregator, judge), what the route needs the target to do (``use``) and the server's
ensemble limits; and records a `Served` on the request's context (the name served, the strategy, the prompt for
the access log with ``server.log.prompts``; later the usage). The replies, the accounting and the access log read
that record, and refuse a request that skipped this step; a test walks every route of the app to check that each
model-naming route refuses a model its key may not use.

After resolve comes the plan (server/plan.py: how this API's reply is produced from the target), then the reply
(server/reply.py). No route forks on "model or ensemble" itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from chorus.config import Limits
from chorus.engines.core.base import EMBEDDINGS, LOGITS, ChoiceScorer, Engine
from chorus.engines.embedding.engine import EmbeddingEngine
from chorus.ensembles.base import Ensemble
from chorus.ensembles.spec import EnsembleSpec
from chorus.errors import CapabilityMismatch, InvalidRequest, ModelNotFound
from chorus.server.gateway import tracing
from chorus.server.gateway.context import Context, Served

#: what a route needs its target to do: generate text (chat, completions, Responses, Messages), read a prompt as a
#: generating model would (count_tokens), score choices, embed, or hold a token-level session
Use = Literal["generate", "count", "score", "embed", "session"]


@dataclass
class ModelTarget:
    """One model serves the request."""

    engine: Engine


@dataclass
class EnsembleTarget:
    """An ensemble serves the request: a named one, or an inline one (served as ``ensemble:STRATEGY``)."""

    ensemble: Ensemble

    @property
    def first_engine(self) -> Engine:
        """The first member's engine (what ``count_tokens`` reads a prompt with)."""
        return self.ensemble.strategy.members[0].engine


Target = ModelTarget | EnsembleTarget


def visible(ctx: Context) -> list[str]:
    """The models and named ensembles the request's key may use, in the config's order: all of them without an
    allow-list. Listings and "not found" messages show only these (a key learns nothing of the others)."""
    services, principal = ctx.services, ctx.principal
    names = [*services.engines, *services.ensembles]
    if principal is None or principal.models is None:
        return names
    return [n for n in names if n in principal.models]


def not_found(ctx: Context, name: str) -> ModelNotFound:
    known = ", ".join(sorted(visible(ctx))) or "none"
    return ModelNotFound(f"The model '{name}' does not exist. Available models: {known}.", param="model")


def resolve(ctx: Context, body: Any, use: Use = "generate") -> Target:
    """What serves ``body`` (its ``model``, and its ``ensemble`` where it may carry one) for this request's key,
    checked for ``use``. A body that generates is first held to the server's request limits; its ``cache_salt``
    (where it has one) narrows the key's prefix-cache scope."""
    if use == "generate":
        body.check_limits(ctx.config.server.limits)
        tracing.request_attributes(ctx.request_id, body.model, body.completion_limit, body.temperature, body.operation)
    ctx.scope = ctx.request_scope(body)  # what every engine call of the request is handed
    ensemble = find_ensemble(ctx, body)
    if ensemble is not None:
        if use == "embed":
            raise CapabilityMismatch(f"'{body.model}' is an ensemble of language models: it generates text and "
                                     "scores choices; it does not embed. Ask an embedding model (GET /v1/models: "
                                     "kind 'embedding').", param="model")
        base = ctx.services.ensembles.get(body.model)
        if base is None:  # an inline ensemble: every model it calls, and the key's leave to compose
            admit(ctx, f"ensemble:{ensemble.spec.strategy}", ensemble.spec.strategy,
                  uses=reached(ensemble), body=body, inline=True)
        else:  # a named one, its body override included: a model it did not call before is checked too
            own = set(reached(base))
            admit(ctx, body.model, ensemble.spec.strategy, uses=[m for m in reached(ensemble) if m not in own],
                  body=body)
        check_limits(ctx.config.server.limits, ensemble)
        return EnsembleTarget(ensemble)
    return ModelTarget(model(ctx, body.model, use, body))


def model(ctx: Context, name: str, use: Use = "generate", body: Any = None) -> Engine:
    """The engine serving ``name`` for this request's key, able to do ``use`` (a route whose body can name no
    ensemble, such as a token session's, calls this rather than `resolve`)."""
    engine = ctx.services.engines.get(name)
    if engine is None:
        raise not_found(ctx, name)
    admit(ctx, name, body=body)
    if use in ("generate", "count"):
        refuse = getattr(engine, "refuse", None)  # a model that generates nothing says what it does instead
        if EMBEDDINGS in engine.capabilities and refuse is not None:
            raise refuse("generate text")
        if isinstance(engine, ChoiceScorer):
            raise CapabilityMismatch(f"The model '{name}' is a multiple-choice scorer: it only scores choices "
                                     "(POST /v1/choices); it cannot generate text.", param="model")
    elif use == "embed" and not isinstance(engine, EmbeddingEngine):
        raise CapabilityMismatch(f"The model '{name}' is not an embedding model: it generates text (chat, "
                                 "completions) and scores choices; ask an embedding model for embeddings (GET "
                                 "/v1/models: kind 'embedding').", param="model")
    elif use == "session" and LOGITS not in engine.capabilities:
        raise CapabilityMismatch(f"{name} has no token-level logits to serve over sessions.", param="model")
    return engine


def admit(ctx: Context, name: str, strategy: str = "", uses: Iterable[str] = (), body: Any = None,
          inline: bool = False) -> Served:
    """Check the key may use ``name`` (and every model the ensemble ``uses``), and record what serves the
    request. An ``inline`` ensemble (``ensemble:STRATEGY``) is no name of the config: the key needs leave to
    compose one (``inline_ensembles``) and every model it uses. The ``body``'s prompt is kept for the access log
    only when ``server.log.prompts`` is on."""
    if ctx.principal is not None:
        if inline:
            ctx.principal.authorize_inline(uses)
        else:
            ctx.principal.authorize([name, *uses])
    prompt = None
    if body is not None and ctx.config.server.log.prompts:
        prompt = body.message_dicts() if getattr(body, "messages", None) is not None else body.prompt
    ctx.served = Served(name, strategy, prompt)
    return ctx.served


def reached(ensemble: Ensemble) -> list[str]:
    """Every served model ``ensemble`` can call: what its strategy declares (members, aggregator, judge ...) and
    every model it looked up while it was built (so a strategy that forgets to declare one is still checked)."""
    looked = getattr(ensemble.strategy.engines, "looked_up", ())
    return list(dict.fromkeys([*ensemble.strategy.models(), *looked]))


class Lookups(dict[str, Engine]):
    """The served engines, remembering every name a strategy looked up (`reached`)."""

    def __init__(self, engines: dict[str, Engine]) -> None:
        super().__init__(engines)
        self.looked_up: list[str] = []

    def __getitem__(self, name: str) -> Engine:
        self.looked_up.append(name)
        return super().__getitem__(name)

    def get(self, name: str, default: Any = None) -> Any:
        self.looked_up.append(name)
        return super().get(name, default)


def find_ensemble(ctx: Context, body: Any) -> Ensemble | None:
    """The ensemble this request asks for: a named one (``model``), the body's ``ensemble``, or both merged."""
    named = ctx.services.ensembles
    base = named.get(body.model)
    inline: dict[str, Any] | None = getattr(body, "ensemble", None)
    if inline is None:
        return base
    try:
        spec = base.spec.merged(inline) if base is not None else EnsembleSpec.model_validate(inline)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise InvalidRequest(f"Invalid 'ensemble' object: {where or 'ensemble'}: {err['msg']}.",
                             param="ensemble" + (f".{where}" if where else "")) from None
    if base is not None and set(inline) <= {"trace"}:  # the same ensemble, its trace asked for: no rebuild
        return Ensemble(spec, base.strategy)  # (an online router's learned state lives in its strategy)
    return Ensemble.build(spec, Lookups(ctx.services.engines), name=body.model if base is not None else None)


def check_limits(limits: Limits, ensemble: Ensemble) -> None:
    """The server's ensemble limits: members, rounds, candidates."""
    members = len(ensemble.strategy.members)
    if members > limits.max_members:
        raise InvalidRequest(f"At most {limits.max_members} ensemble members on this server (got {members}).",
                             param="ensemble.members")
    budget = ensemble.strategy.budget()
    if budget.rounds > limits.max_rounds:
        raise InvalidRequest(f"'max_rounds' must be at most {limits.max_rounds} on this server.",
                             param="ensemble.max_rounds")
    if budget.candidates > limits.max_candidates:
        raise InvalidRequest(f"At most {limits.max_candidates} candidates (given or sampled) per ensemble request "
                             f"on this server (got {budget.candidates}).", param="ensemble.candidates")
