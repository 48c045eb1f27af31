"""Who used what: token charges to the key (per model used) and the token metrics, once a request's usage is known;
and the request kept for feedback (server/api/extensions/feedback.py) with its tokens, cost and an online router's decision."""

from __future__ import annotations

import secrets
import time
from typing import Any

from chorus.server.gateway import tracing
from chorus.server.gateway.context import Context
from chorus.server.gateway.feedback_store import book_entry
from chorus.server.gateway.key_state import Charge, cost_of
from chorus.server.gateway.metrics import TTFT, count_tokens


def settle(ctx: Context, model: str, usage: dict[str, Any]) -> None:
    """Charge the key (its token window, budget and spend: one charge per model used, an ensemble's member
    calls each to their own model) and count the tokens, once the usage is known."""
    prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
    tracing.usage_attributes(usage)
    served, principal, services = ctx.resolved(), ctx.principal, ctx.services
    members = served.member_usage  # an ensemble: what each member model used
    used = members() if members is not None else {model: (prompt, completion)}
    costs = {m: cost_of(services.config.prices, m, p, c) for m, (p, c) in used.items()}
    if principal is not None:
        rid = ctx.admission_id or secrets.token_hex(16)
        services.key_state.charge([Charge(f"{rid}:{m}", principal.name, m, p + c, costs[m])
                                for m, (p, c) in used.items()])
        if ctx.reservation is not None:  # the real usage takes the worst case's place (server/reserve.py)
            services.key_state.unreserve(principal, ctx.reservation)
            ctx.reservation = None
    count_tokens(model, prompt, completion)
    served.usage = {"prompt_tokens": prompt, "completion_tokens": completion}
    keep(ctx, sum(p + c for p, c in used.values()), sum(costs.values()))


def first_token(ctx: Context) -> None:
    TTFT.labels(ctx.resolved().model).observe(time.perf_counter() - ctx.started)


def keep(ctx: Context, tokens: int, price: float) -> None:
    """Keep this answered request for feedback (from ``settle``, once its usage is known)."""
    if not ctx.config.server.feedback.metrics:
        return  # (no metric declared: no feedback can come, nothing is kept)
    served = ctx.resolved()
    decision = served.decision() if served.decision is not None else None
    ctx.services.feedback.remember(book_entry(ctx.owner, ctx.request_id), {"key": ctx.owner, "model": served.model,
                        "t": time.time(), "tokens": tokens, "price": price, "decision": decision})
