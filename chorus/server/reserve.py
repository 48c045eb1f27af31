"""Budgets and token windows that hold before the spend: between resolve and plan, a generating request reserves
its worst case against its key's budget (``max_budget``) and token window (``tpm``); the reservation is settled
to the real usage when the response ends (server/gateway/accounting.py: ``settle``) and dropped if it never
does (the front door, when the request ends). Concurrent requests therefore cannot together pass a budget that
each alone fits, and one request (``n: 16``, an ensemble) cannot spend past it.

The worst case, reserved once the request is planned (its prompt encoded):

- a model: the prompt's tokens (exact) + ``max_tokens`` (or, without one, the model's context window) x ``n``
  x prompts: a budget or a tpm window is never passed by a one-model request;
- an ensemble: completions of each call's ``max_tokens`` (the request's, else ``call_max_tokens``) x ``n`` x the
  calls its strategy may make (members x rounds, candidates, a judge), at most its own bound
  ``max_total_tokens``, counted twice (rounds and a judge read the answers before them), + the prompt (in the
  first member's tokens) read by every call: an estimate, as a strategy's prompts carry other members' answers;

in currency at the most expensive price (prompt or completion) among the models it may call.
"""

from __future__ import annotations

import json
from typing import Any

from chorus.server.gateway.context import Context
from chorus.server.gateway.key_state import Reservation
from chorus.server.plan import ReplyPlan
from chorus.server.resolve import EnsembleTarget, ModelTarget, Target, reached


def worst_case(ctx: Context, body: Any, target: Target, work: ReplyPlan) -> tuple[int, list[str]]:
    """The most tokens ``body`` may cost on ``target`` as planned (``work``), and the models that may spend them."""
    n = max(1, int(getattr(body, "n", 1) or 1))
    prompts = len(body.prompt) if isinstance(getattr(body, "prompt", None), list) and body.prompt \
        and not isinstance(body.prompt[0], int) else 1
    limit = body.completion_limit
    if isinstance(target, ModelTarget):  # the prompt exactly (it is encoded), the completions at most
        engine = target.engine
        completion = limit if limit is not None else int(getattr(engine, "max_model_len", 0) or 0)
        return work.tokens(0)[0] + completion * n * prompts, [ctx.resolved().model]
    assert isinstance(target, EnsembleTarget)
    ensemble = target.ensemble
    models = reached(ensemble)
    per_call = limit or ensemble.spec.call_max_tokens
    bound = ensemble.strategy.budget()
    members = len(ensemble.strategy.members)
    calls = members * (bound.rounds + 1) + bound.candidates + 1
    completions = per_call * n * calls
    if ensemble.spec.max_total_tokens is not None:
        completions = min(completions, ensemble.spec.max_total_tokens)
    first = ensemble.strategy.members[0].engine
    question = body.prompt if isinstance(getattr(body, "prompt", None), str) else json.dumps(
        getattr(body, "messages", None) or getattr(body, "prompt", ""), default=str)
    prompt = len(first.tokenizer.encode(question)) if isinstance(question, str) else 0
    # every call reads the prompt; rounds and a judge read the answers before them again
    return (completions * 2 + prompt * calls) * prompts, models


async def reserve(ctx: Context, body: Any, target: Target, work: ReplyPlan) -> None:
    """Reserve ``body``'s worst case for its key (a 429 ``budget_exceeded`` or ``rate_limit_exceeded`` naming
    what the request may cost and what is left, before any work)."""
    principal = ctx.principal
    if principal is None or not ctx.admission_id:
        return
    tokens, models = worst_case(ctx, body, target, work)
    prices = ctx.config.prices
    worst_price = max((max(prices[m].completion, prices[m].prompt) for m in models if m in prices), default=0.0)
    ctx.reservation = Reservation(ctx.admission_id, tokens, tokens * worst_price / 1e6)
    await ctx.services.key_state.reserve(principal, ctx.reservation)
