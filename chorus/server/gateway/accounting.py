"""Who used what: token charges to the key (per model used) and the token metrics, once a request's usage is known;
and the request kept for feedback (server/feedback.py) with its tokens, cost and an online router's decision."""

from __future__ import annotations

import secrets
import time
from typing import Any

from fastapi import Request

from chorus.server import tracing
from chorus.server.key_state import Charge, cost_of
from chorus.server.metrics import TTFT, count_tokens
from chorus.server.resolve import Served, served_of


def settle(request: Request, model: str, usage: dict[str, Any]) -> None:
    """Charge the key (its token window, budget and spend: one charge per model used, an ensemble's member
    calls each to their own model) and count the tokens, once the usage is known."""
    prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
    tracing.usage_attributes(usage)
    served = served_of(request)
    principal = getattr(request.state, "principal", None)
    state = request.app.state
    members = served.member_usage  # an ensemble: what each member model used
    used = members() if members is not None else {model: (prompt, completion)}
    costs = {m: cost_of(state.config.prices, m, p, c) for m, (p, c) in used.items()}
    if principal is not None:
        rid = getattr(request.state, "admission_id", "") or secrets.token_hex(16)
        state.key_state.charge([Charge(f"{rid}:{m}", principal.name, m, p + c, costs[m])
                                for m, (p, c) in used.items()])
    count_tokens(model, prompt, completion)
    served.usage = {"prompt_tokens": prompt, "completion_tokens": completion}
    keep(request, sum(p + c for p, c in used.values()), sum(costs.values()))


def first_token(request: Request, model: str) -> None:
    started = getattr(request.state, "started", None)
    if started is not None:
        TTFT.labels(model).observe(time.perf_counter() - started)


def keep(request: Request, tokens: int, price: float) -> None:
    """Keep this answered request for feedback (from ``settle``, once its usage is known)."""
    book = getattr(request.app.state, "feedback", None)
    rid = getattr(request.state, "request_id", None)
    if book is None or rid is None or not request.app.state.config.server.feedback.metrics:
        return  # (no metric declared: no feedback can come, nothing is kept)
    served = served_of(request)
    principal = getattr(request.state, "principal", None)
    decision = served.decision() if isinstance(served, Served) and served.decision is not None else None
    book.remember(rid, {"key": principal.name if principal is not None else None, "model": served.model,
                        "t": time.time(), "tokens": tokens, "price": price, "decision": decision})
