"""Who used what: the key's model allow-list, the request's labels for logs and metrics, and token charges."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable
from typing import Any

from fastapi import Request

from chorus.server.key_state import Charge, cost_of
from chorus.server.metrics import TTFT, count_tokens


def served_by(request: Request, model: str, strategy: str = "", uses: Iterable[str] = (),
              body: Any = None) -> None:
    """Check the key may use ``model`` (and, for an inline ensemble, every model it ``uses``); label the request.
    The request ``body``'s prompt goes into the access log only when ``server.log.prompts`` is on."""
    principal = getattr(request.state, "principal", None)
    if principal is not None:
        principal.authorize([model, *uses])
    request.state.model = model
    request.state.strategy = strategy
    if body is not None and request.app.state.config.server.log.prompts:
        request.state.prompt = body.message_dicts() if getattr(body, "messages", None) is not None else body.prompt


def settle(request: Request, model: str, usage: dict[str, Any]) -> None:
    """Charge the key (its token window, budget and spend: one charge per model used, an ensemble's member
    calls each to their own model) and count the tokens, once the usage is known."""
    prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
    principal = getattr(request.state, "principal", None)
    if principal is not None:
        state = request.app.state
        rid = getattr(request.state, "admission_id", "") or secrets.token_hex(16)
        members = getattr(request.state, "member_usage", None)  # an ensemble: what each member model used
        used = members() if members is not None else {model: (prompt, completion)}
        state.key_state.charge([Charge(f"{rid}:{m}", principal.name, m, p + c, cost_of(state.config.prices, m, p, c))
                                for m, (p, c) in used.items()])
    count_tokens(model, prompt, completion)
    request.state.usage = {"prompt_tokens": prompt, "completion_tokens": completion}


def first_token(request: Request, model: str) -> None:
    started = getattr(request.state, "started", None)
    if started is not None:
        TTFT.labels(model).observe(time.perf_counter() - started)
