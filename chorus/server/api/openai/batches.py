"""``/v1/batches``: create, retrieve, list and cancel batches, as OpenAI's Batch API (server/batch/ runs them). A
key sees only its own batches: another key's batch id is a 404 like an unknown one."""

from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter, Query
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from chorus.errors import InvalidRequest, NotFound
from chorus.server.api.openai.embeddings import EmbeddingsRequest
from chorus.server.api.openai.responses.wire import ResponsesRequest
from chorus.server.batch.render import batch_object
from chorus.server.batch.runner import batches_of
from chorus.server.gateway.context import Context, Ctx
from chorus.server.reply import json_response
from chorus.server.wire.request import ChatCompletionRequest, CompletionRequest

router = APIRouter()
#: what a batch may run, and the request model its lines' bodies must pass (the app gives it to the batch runner)
ENDPOINTS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/embeddings": EmbeddingsRequest,
    "/v1/responses": ResponsesRequest,
}
_WINDOW = re.compile(r"^(\d+)([smhd])$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86_400}


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1)
    endpoint: str
    #: OpenAI accepts "24h" only; chorus any duration ("30m", "2h", "7d") up to server.batches.max_completion_window_s
    completion_window: str = "24h"
    #: up to 16 pairs, keys up to 64 characters, values up to 512 (as OpenAI)
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    output_expires_after: dict[str, object] | None = None


def window_seconds(ctx: Context, window: str) -> float:
    m = _WINDOW.match(window)
    longest = ctx.config.server.batches.max_completion_window_s
    seconds = int(m.group(1)) * _UNIT[m.group(2)] if m else 0
    if not 0 < seconds <= longest:
        raise InvalidRequest(f"completion_window {window!r} must be a duration such as \"24h\" (s, m, h or d), "
                             f"more than 0 and at most {longest:g} s.", param="completion_window")
    return float(seconds)


@router.post("/v1/batches", response_model=None)
async def create(body: BatchRequest, ctx: Ctx) -> Response:
    batches = batches_of(ctx)
    if body.endpoint not in ENDPOINTS:
        raise InvalidRequest(f"endpoint {body.endpoint!r} is not supported for batches; use one of: "
                             f"{', '.join(ENDPOINTS)}.", param="endpoint")
    if body.output_expires_after is not None:
        raise InvalidRequest("output_expires_after is not supported: output files are kept until deleted.",
                             param="output_expires_after")
    for k, v in (body.metadata or {}).items():
        if len(k) > 64 or len(v) > 512:
            raise InvalidRequest("metadata keys are at most 64 characters and values at most 512.", param="metadata")
    seconds = window_seconds(ctx, body.completion_window)
    owner = ctx.owner or ""
    store = await batches.open()
    found = await store.file(body.input_file_id, owner)
    if found is None:
        raise NotFound(f"No file with id {body.input_file_id!r}.", param="input_file_id")
    if found["purpose"] != "batch":
        raise InvalidRequest(f"The file {body.input_file_id} has purpose {found['purpose']!r}; a batch's input "
                             "must be uploaded with purpose \"batch\".", param="input_file_id")
    row = await store.add_batch(owner, body.endpoint, body.input_file_id, body.completion_window, seconds,
                                body.metadata)
    batches.poke()
    return json_response(await batch_object(row, store))


async def owned(ctx: Context, batch_id: str) -> dict[str, Any]:
    row = await (await batches_of(ctx).open()).batch(batch_id, ctx.owner or "")
    if row is None:
        raise NotFound(f"No batch with id {batch_id!r}.", param="batch_id")
    return row


@router.get("/v1/batches/{batch_id}", response_model=None)
async def retrieve(batch_id: str, ctx: Ctx) -> Response:
    return json_response(await batch_object(await owned(ctx, batch_id), await batches_of(ctx).open()))


@router.post("/v1/batches/{batch_id}/cancel", response_model=None)
async def cancel(batch_id: str, ctx: Ctx) -> Response:
    batches = batches_of(ctx)
    store = await batches.open()
    row = await owned(ctx, batch_id)
    if row["status"] not in ("cancelling", "cancelled"):
        if not await store.move(batch_id, ("validating", "in_progress"), "cancelling"):
            raise InvalidRequest(f"The batch {batch_id} is {row['status']}: only a validating or in-progress batch "
                                 "can be cancelled.", param="batch_id", code="batch_not_cancellable")
        batches.poke()
    return json_response(await batch_object(await owned(ctx, batch_id), store))


@router.get("/v1/batches", response_model=None)
async def list_batches(ctx: Ctx, after: str | None = None, limit: int = Query(default=20, ge=1, le=100)) -> Response:
    store = await batches_of(ctx).open()
    rows = await store.batches(ctx.owner or "", after, limit + 1)
    data = [await batch_object(r, store) for r in rows[:limit]]
    return json_response({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                          "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit})
