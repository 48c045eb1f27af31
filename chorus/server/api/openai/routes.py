"""OpenAI's ``POST /v1/chat/completions`` and ``POST /v1/completions``: resolve, plan, reply, on any model or ensemble
(named, or the body's ``ensemble``)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from chorus.server import plan
from chorus.server.gateway.context import Context, Ctx
from chorus.server.reply import ReplyShape, chat_reply, completion_reply
from chorus.server.reserve import reserve
from chorus.server.resolve import resolve
from chorus.server.wire import request as wire

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(req: wire.ChatCompletionRequest, ctx: Ctx) -> Response:
    return await chat(ctx, req)


async def chat(ctx: Context, req: wire.ChatCompletionRequest, shape: ReplyShape | None = None) -> Response:
    """A chat request, answered in OpenAI's shape or in another API's (``shape``: Responses, Messages)."""
    target = resolve(ctx, req)
    work = plan.chat(ctx, target, req)
    await reserve(ctx, req, target, work)  # the worst case held against the key's budget and tpm
    return await chat_reply(ctx, req, work, shape)


@router.post("/v1/completions", response_model=None)
async def completions(req: wire.CompletionRequest, ctx: Ctx) -> Response:
    target = resolve(ctx, req)
    work = await plan.completion(ctx, target, req)
    await reserve(ctx, req, target, work)
    return await completion_reply(ctx, req, work)
