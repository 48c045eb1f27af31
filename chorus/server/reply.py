"""The reply, the last of a route's three steps (resolve, plan, reply), the same for a model and an ensemble: run
or stream the plan (server/plan.py), then OpenAI JSON (usage, ``n`` choices, the trace trailer) or SSE chunks,
with the key charged once. Other APIs' shapes (Responses, Messages) wrap the chat reply (`ReplyShape`). Streams
are opened before the first byte: their first delta is pulled under the client's disconnect watch, so prefill and
validation errors are HTTP errors; text-level ensembles (``prefetch=False``) start the SSE stream at once instead and report a
failure as the final error event.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

from pydantic_core import to_json
from starlette.responses import Response

from chorus.engines.core.base import Delta
from chorus.server.gateway.accounting import first_token, settle
from chorus.server.gateway.context import Context
from chorus.server.gateway.streaming import sse_response, until_disconnect
from chorus.server.plan import ReplyPlan
from chorus.server.wire import render
from chorus.server.wire import request as wire
from chorus.server.wire.render import chat_events, completion_events, first_and_rest


def json_response(body: dict[str, Any]) -> Response:
    """A finished response body as JSON bytes (pydantic-core's encoder): skips FastAPI's jsonable_encoder
    walk and the stdlib json.dumps, a measurable share of a non-streamed request (chorus bench gateway)."""
    return Response(to_json(body), media_type="application/json")


async def open_streams(ctx: Context, work: ReplyPlan) -> list[AsyncGenerator[Delta, None]]:
    if not work.prefetch:
        return [open_() for open_ in work.stream]
    opened = await until_disconnect(ctx, asyncio.gather(
        *(first_and_rest(open_()) for open_ in work.stream), return_exceptions=True))
    streams = [s for s in opened if not isinstance(s, BaseException)]
    failed = [s for s in opened if isinstance(s, BaseException)]
    if failed:  # prompts are prefilled together; if one fails, close the others and report it
        for s in streams:
            await s.aclose()
        raise failed[0]
    first_token(ctx)
    return streams


class ReplyShape(Protocol):
    """Another API's shape for a chat reply (passed to `chat_reply`: the Responses API,
    api/openai/responses/, api/anthropic/): the finished chat body, or the chat chunks, become that API's."""

    named_events: bool  #: SSE events named by their ``type`` (and no ``[DONE]``)

    def body(self, chat: dict[str, Any]) -> dict[str, Any]: ...

    def events(self, chunks: AsyncGenerator[dict[str, Any], None]) -> AsyncGenerator[dict[str, Any], None]: ...


def usage_of(work: ReplyPlan) -> Callable[[int], dict[str, Any]]:
    """A stream's usage object from the completion tokens it sent."""
    return lambda completion: render.usage(*work.tokens(completion))


async def chat_reply(ctx: Context, req: wire.ChatCompletionRequest, work: ReplyPlan,
                     shape: ReplyShape | None = None) -> Response:
    model, head = ctx.resolved().model, render.ResponseHead("chatcmpl", req.model, work.fingerprint)
    if not req.stream:
        gen = await until_disconnect(ctx, work.generate[0]())
        body = {**render.chat_response(head, gen, req.tool_set), **work.trailer()}
        settle(ctx, model, body["usage"])
        return json_response(shape.body(body) if shape else body)
    (deltas,) = await open_streams(ctx, work)
    chunks = chat_events(head, deltas, req, usage_of(work), trailer=work.trailer,
                         settle=lambda u: settle(ctx, model, u))
    if shape is None:
        return sse_response(chunks, ctx)
    return sse_response(shape.events(chunks), ctx, named=shape.named_events)


async def completion_reply(ctx: Context, req: wire.CompletionRequest, work: ReplyPlan) -> Response:
    model, head = ctx.resolved().model, render.ResponseHead("cmpl", req.model, work.fingerprint)
    echoes = work.echoes
    scored = [render.prompt_logprobs(tokens, lps) for tokens, lps in work.scored] if work.scored else None
    if not req.stream:
        gens = await until_disconnect(ctx, asyncio.gather(*(g() for g in work.generate)))
        choices = []
        for p, gen in enumerate(gens):
            for c in gen.choices:
                lps = render.completion_logprobs(c.logprobs, len(echoes[p])) if c.logprobs is not None else None
                lps = render.joined_logprobs(scored[p] if scored else None, lps)
                choices.append(
                    render.completion_choice(p * req.n + c.index, echoes[p] + c.text, c.finish_reason, lps)
                )
        body = {**render.completion_response(head, choices, sum(g.prompt_tokens for g in gens),
                                               sum(g.completion_tokens for g in gens),
                                               sum(g.cached_tokens for g in gens)), **work.trailer()}
        settle(ctx, model, body["usage"])
        return json_response(body)
    streams = await open_streams(ctx, work)
    return sse_response(completion_events(head, streams, echoes, req, usage_of(work), trailer=work.trailer,
                                          settle=lambda u: settle(ctx, model, u), scored=scored), ctx)
