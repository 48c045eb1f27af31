"""``POST /v1/feedback``: what became of an answer (a thumbs up, a test that passed, a grade), joined to the request
by the id chorus returned for it (the ``X-Request-ID`` header; the openai SDK's ``response._request_id``).

Body: ``request_id``, ``metric`` (one of ``server.feedback.metrics``), ``value`` (``true``/``false`` for a boolean
metric, a number for a number metric, within its ``min``/``max`` when given). From the key that made the request
(any replica: the records are in the shared state store). Refused, each naming the field: an undeclared metric or
a value of the wrong type (400), another key's request (404, as an unknown one), an id that is unknown or older than
``feedback.keep_s`` (404), a second feedback on the same metric for one request (409), the shared state store
(Redis) out of reach (503 with ``Retry-After``; nothing is marked, so the same feedback can be sent again). When an online router
decided the request and learns from that metric, it learns the reward (``learned_by`` in the reply names it).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from chorus.config import FeedbackMetric
from chorus.errors import (
    FeedbackExists,
    GatewayError,
    InvalidRequest,
    RequestNotFound,
    StoreUnavailable,
)
from chorus.server.gateway.context import Context, Ctx
from chorus.server.gateway.feedback_store import book_entry
from chorus.server.reply import json_response

router = APIRouter()
FEEDBACK = Counter("chorus_feedback_total", "feedback received, per metric and outcome", ["metric", "outcome"])


class FeedbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1, max_length=200)
    metric: str = Field(min_length=1)
    value: StrictBool | StrictInt | StrictFloat


def declared(ctx: Context, name: str) -> FeedbackMetric:
    metrics = {m.name: m for m in ctx.config.server.feedback.metrics}
    found = metrics.get(name)
    if found is None:
        raise InvalidRequest(f"Unknown feedback metric {name!r}; this server accepts: "
                             f"{', '.join(sorted(metrics)) or 'none (server.feedback.metrics is empty)'}.",
                             param="metric")
    return found


def checked_value(metric: FeedbackMetric, value: bool | float) -> float:
    if metric.type == "boolean":
        if not isinstance(value, bool):
            raise InvalidRequest(f"The metric {metric.name!r} is boolean: 'value' must be true or false.",
                                 param="value")
        return float(value)
    if isinstance(value, bool):
        raise InvalidRequest(f"The metric {metric.name!r} is a number: 'value' must be a number, not "
                             f"{str(value).lower()}.", param="value")
    if (metric.min is not None and value < metric.min) or (metric.max is not None and value > metric.max):
        raise InvalidRequest(f"'value' {value} is outside the metric {metric.name!r}'s range "
                             f"[{metric.min}, {metric.max}].", param="value")
    return float(value)


@router.post("/v1/feedback", response_model=None)
async def feedback(body: FeedbackRequest, ctx: Ctx) -> Response:
    metric = declared(ctx, body.metric)
    value = checked_value(metric, body.value)
    try:
        return await join(ctx, body, metric, value)
    except Exception as exc:
        from chorus.server.gateway.redis_state import is_outage

        if not isinstance(exc, GatewayError) and is_outage(exc):
            FEEDBACK.labels(metric.name, "store_unavailable").inc()
            raise StoreUnavailable("The shared state store (Redis) cannot be reached, so this feedback cannot be "
                                   "joined to its request now; retry shortly.", retry_after=1.0) from exc
        raise


async def join(ctx: Context, body: FeedbackRequest, metric: FeedbackMetric, value: float) -> Response:
    """Find the request, check its key, mark the metric (once), and let an online router that decided it learn."""
    book = ctx.services.feedback
    entry = book_entry(ctx.owner, body.request_id)  # each key's ids apart: a client's X-Request-ID squats nothing
    record = await book.recall(entry)
    keep_s = ctx.config.server.feedback.keep_s
    mine = record is not None and record["key"] == ctx.owner
    if record is not None and not mine:
        FEEDBACK.labels(metric.name, "other_key").inc()
    elif record is None:
        FEEDBACK.labels(metric.name, "unknown_request").inc()
    if not mine:  # another key's request is as unknown as a missing one (request ids may be the client's own)
        raise RequestNotFound(f"No request {body.request_id!r} of this key to give feedback on: unknown, made with "
                              f"another key, or older than {keep_s:g} s (server.feedback.keep_s).",
                              param="request_id")
    assert record is not None
    if not await book.mark(entry, metric.name, value):
        FEEDBACK.labels(metric.name, "duplicate").inc()
        raise FeedbackExists(f"The request {body.request_id!r} already has feedback on {metric.name!r}.",
                             param="metric")
    learned_by = None
    decision: dict[str, Any] | None = record.get("decision")
    if decision is not None:
        ensemble = ctx.services.ensembles.get(str(decision.get("ensemble")))
        if ensemble is not None and ensemble.strategy.feedback_metric() == metric.name:
            try:
                if await ensemble.strategy.learn(decision, metric.quality(value), record["tokens"], record["price"]):
                    learned_by = decision["ensemble"]
            except BaseException:
                await book.unmark(entry, metric.name)  # not learned: the client may send it again
                raise
    FEEDBACK.labels(metric.name, "accepted").inc()
    return json_response({"object": "feedback", "request_id": body.request_id, "metric": metric.name,
                          "value": body.value, "model": record["model"], "learned_by": learned_by,
                          "arm": decision["arm"] if learned_by and decision is not None else None})
