"""``POST /v1/embeddings`` on the embedding models of the config (engines/embedding/engine.py), as OpenAI's.

``input``: a string, a list of strings, one list of token ids, or a list of them (the model's own ids), at most
``server.limits.max_embedding_inputs`` per request; ``encoding_format``: ``float`` or ``base64`` (little-endian
float32, as OpenAI's); ``dimensions``: only the model's own (none of the served models is trained to be cut
shorter, so another value is a 400). A language model asked for embeddings, or an embedding model asked to
generate, is a 400 naming ``model`` and what it can do.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from chorus.engines.core.base import INT_MAX
from chorus.engines.embedding.engine import EmbeddingEngine
from chorus.errors import InvalidRequest
from chorus.server.gateway.accounting import settle
from chorus.server.gateway.context import Ctx
from chorus.server.gateway.streaming import until_disconnect
from chorus.server.reply import json_response
from chorus.server.resolve import ModelTarget, resolve

router = APIRouter()


class EmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, le=INT_MAX)
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        if isinstance(x, str):
            return [x]
        if not x:
            raise InvalidRequest("'input' must not be empty.", param="input")
        if all(isinstance(t, int) for t in x):
            return [list(x)]  # type: ignore[arg-type]
        return list(x)  # type: ignore[arg-type]


def encode(vector: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(np.ascontiguousarray(vector, dtype="<f4").tobytes()).decode()
    return [float(v) for v in vector]


@router.post("/v1/embeddings", response_model=None)
async def embeddings(req: EmbeddingsRequest, ctx: Ctx) -> Response:
    target = resolve(ctx, req, use="embed")
    engine = target.engine if isinstance(target, ModelTarget) else None
    assert isinstance(engine, EmbeddingEngine)  # resolve refused ensembles and every other kind of model
    if req.dimensions is not None and req.dimensions != engine.dimensions:
        raise InvalidRequest(f"'{req.model}' gives {engine.dimensions}-dimensional embeddings and cannot be "
                             f"shortened (it is not trained for it); leave 'dimensions' out or send "
                             f"{engine.dimensions}.", param="dimensions")
    inputs = req.inputs()
    most = ctx.config.server.limits.max_embedding_inputs
    if len(inputs) > most:
        raise InvalidRequest(f"At most {most} inputs per request on this server (got {len(inputs)}).", param="input")
    ids = engine.token_ids(inputs)
    vectors = await until_disconnect(ctx, engine.embed(ids))
    tokens = sum(len(x) for x in ids)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    settle(ctx, req.model, {"prompt_tokens": tokens, "completion_tokens": 0})
    data: list[dict[str, Any]] = [{"object": "embedding", "index": i, "embedding": encode(v, req.encoding_format)}
                                  for i, v in enumerate(vectors)]
    return json_response({"object": "list", "data": data, "model": req.model, "usage": usage})
