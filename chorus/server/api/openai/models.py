"""What is served: ``GET /v1/models`` and one model's card (OpenAI's model object, with chorus's kind and
capabilities)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from chorus.engines.core.base import EMBEDDINGS, TOOLS, ChoiceScorer
from chorus.server.gateway.context import Context, Ctx
from chorus.server.resolve import not_found, visible

router = APIRouter()


def model_card(ctx: Context, name: str) -> dict[str, Any]:
    """OpenAI's model object, plus chorus's ``kind`` (language_model, scorer, ensemble) and ``capabilities``."""
    services = ctx.services
    card: dict[str, Any] = {"id": name, "object": "model", "created": services.started, "owned_by": "chorus"}
    if name in services.ensembles:
        e = services.ensembles[name]
        card["kind"] = "ensemble"
        allowed = ctx.principal.models if ctx.principal is not None else None
        shown = [m.label for m in e.strategy.members if allowed is None or m.spec.model in allowed]
        card["ensemble"] = {"strategy": e.spec.strategy, "members": shown, "description": e.description}
        if len(shown) < len(e.strategy.members):  # a member the key may not use is not named to it
            card["ensemble"]["members_not_shown"] = len(e.strategy.members) - len(shown)
        return card
    engine = services.engines[name]
    card["kind"] = "scorer" if isinstance(engine, ChoiceScorer) else (
        "embedding" if EMBEDDINGS in engine.capabilities else "language_model")
    card["capabilities"] = sorted(engine.capabilities)
    spec = next((m for m in services.config.models if m.name == name), None)
    if spec is not None and spec.description:
        card["description"] = spec.description
    if EMBEDDINGS in engine.capabilities:
        card["embedding"] = getattr(engine, "description", {})
    if TOOLS in engine.capabilities:  # how functions reach it: its own template, or chorus's JSON fallback
        card["tool_format"] = "native" if engine.tokenizer.supports_tools else "json"
    if isinstance(engine, ChoiceScorer):
        card["scorer"] = engine.description
    price = services.config.prices.get(name)
    if price is not None:  # the config's price table (per million tokens): budgets, and the playground's cost
        card["pricing"] = {"prompt": price.prompt, "completion": price.completion, "per_tokens": 1_000_000}
    return card


@router.get("/v1/models")
async def list_models(ctx: Ctx) -> dict[str, Any]:
    """The models and named ensembles this key may use (every one without an allow-list)."""
    return {"object": "list", "data": [model_card(ctx, n) for n in visible(ctx)]}


@router.get("/v1/models/{name:path}")
async def get_model(name: str, ctx: Ctx) -> dict[str, Any]:
    if name not in visible(ctx):  # another key's model is as absent as an unknown one
        raise not_found(ctx, name)
    return model_card(ctx, name)
