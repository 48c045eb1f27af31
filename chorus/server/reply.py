"""The response tail every completion shares, single model or ensemble: run or stream the work, then
OpenAI JSON (usage, ``n`` choices, the trace trailer) or SSE chunks, with the key charged once.

A route builds a `ReplyPlan` (how to answer each prompt whole or as a stream, the prompt tokens, the trailer)
and hands it to `chat_reply` or `completion_reply`. Streams are opened before the first byte: their
first delta is pulled under the client's disconnect watch, so prefill and validation errors are HTTP
errors; text-level ensembles (``prefetch=False``) start the SSE stream at once instead and report a
failure as the final error event.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request
from pydantic_core import to_json
from starlette.responses import Response

from chorus.engines.core.base import Choice, Delta, Generation, GenerationRequest, TokenLogprob
from chorus.server import protocol
from chorus.server.accounting import first_token, settle
from chorus.server.events import chat_events, completion_events, first_and_rest
from chorus.server.resolve import served_of
from chorus.server.streaming import sse_response, until_disconnect


@dataclass
class ReplyPlan:
    """What answers a request: per prompt, a whole generation or a stream of deltas."""

    generate: list[Callable[[], Awaitable[Generation]]]
    stream: list[Callable[[], AsyncGenerator[Delta, None]]]
    #: a stream's usage from the completion tokens it sent (an ensemble counts every member call instead)
    usage: Callable[[int], dict[str, int]]
    trailer: Callable[[], dict[str, Any]] = dict  #: extra top-level fields at the end (``trace``, ``ensemble``)
    prefetch: bool = True  #: pull each stream's first delta before the first byte


def json_response(body: dict[str, Any]) -> Response:
    """A finished response body as JSON bytes (pydantic-core's encoder): skips FastAPI's jsonable_encoder
    walk and the stdlib json.dumps, a measurable share of a non-streamed request (chorus bench gateway)."""
    return Response(to_json(body), media_type="application/json")


async def open_streams(request: Request, work: ReplyPlan) -> list[AsyncGenerator[Delta, None]]:
    if not work.prefetch:
        return [open_() for open_ in work.stream]
    opened = await until_disconnect(request, asyncio.gather(
        *(first_and_rest(open_()) for open_ in work.stream), return_exceptions=True))
    streams = [s for s in opened if not isinstance(s, BaseException)]
    failed = [s for s in opened if isinstance(s, BaseException)]
    if failed:  # prompts are prefilled together; if one fails, close the others and report it
        for s in streams:
            await s.aclose()
        raise failed[0]
    first_token(request, served_of(request).model)
    return streams


class ReplyShape(Protocol):
    """Another API's shape for a chat reply (passed to `chat_reply`: the Responses API,
    server/responses.py): the finished chat body, or the chat chunks, become that API's."""

    named_events: bool  #: SSE events named by their ``type`` (and no ``[DONE]``)

    def body(self, chat: dict[str, Any]) -> dict[str, Any]: ...

    def events(self, chunks: AsyncGenerator[dict[str, Any], None]) -> AsyncGenerator[dict[str, Any], None]: ...


async def chat_reply(
    request: Request, req: protocol.ChatCompletionRequest, head: protocol.ResponseHead, work: ReplyPlan,
    shape: ReplyShape | None = None,
) -> Response:
    model = served_of(request).model
    if not req.stream:
        gen = await until_disconnect(request, work.generate[0]())
        body = {**protocol.chat_response(head, gen, req.tool_set), **work.trailer()}
        settle(request, model, body["usage"])
        return json_response(shape.body(body) if shape else body)
    (deltas,) = await open_streams(request, work)
    chunks = chat_events(head, deltas, req, work.usage, trailer=work.trailer,
                         settle=lambda u: settle(request, model, u))
    if shape is None:
        return sse_response(chunks, request)
    return sse_response(shape.events(chunks), request, named=shape.named_events)


async def completion_reply(
    request: Request,
    req: protocol.CompletionRequest,
    head: protocol.ResponseHead,
    work: ReplyPlan,
    echoes: list[str],
    scored: list[dict[str, Any]] | None = None,
) -> Response:
    """``echoes[p]``: prompt p's text when the client asked for ``echo`` (else ""); choice p*n+i.
    ``scored[p]``: prompt p's token logprobs (``echo`` with ``logprobs``), before the completion's."""
    model = served_of(request).model
    if not req.stream:
        gens = await until_disconnect(request, asyncio.gather(*(g() for g in work.generate)))
        choices = []
        for p, gen in enumerate(gens):
            for c in gen.choices:
                lps = protocol.completion_logprobs(c.logprobs, len(echoes[p])) if c.logprobs is not None else None
                lps = protocol.joined_logprobs(scored[p] if scored else None, lps)
                choices.append(
                    protocol.completion_choice(p * req.n + c.index, echoes[p] + c.text, c.finish_reason, lps)
                )
        body = {**protocol.completion_response(head, choices, sum(g.prompt_tokens for g in gens),
                                               sum(g.completion_tokens for g in gens),
                                               sum(g.cached_tokens for g in gens)), **work.trailer()}
        settle(request, model, body["usage"])
        return json_response(body)
    streams = await open_streams(request, work)
    return sse_response(completion_events(head, streams, echoes, req, work.usage, trailer=work.trailer,
                                          settle=lambda u: settle(request, model, u), scored=scored), request)


async def nothing(gen_req: GenerationRequest, n: int, prompt_tokens: int | None = None) -> Generation:
    """``max_tokens: 0``: n empty choices (the echo is the answer); an ensemble counts every member's prompt."""
    lps: list[TokenLogprob] | None = [] if gen_req.params.logprobs else None
    used = len(gen_req.prompt_ids) if prompt_tokens is None else prompt_tokens
    return Generation([Choice(i, "", [], "length", lps) for i in range(n)], used, 0)


async def nothing_streamed(n: int) -> AsyncGenerator[Delta, None]:
    for i in range(n):
        yield Delta(i, "", [], [], "length")
