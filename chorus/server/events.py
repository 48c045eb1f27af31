"""Formatting of streams: engine deltas -> OpenAI chat / text-completion chunks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import Any

from chorus.engines.core.base import Delta
from chorus.errors import GatewayError
from chorus.server import protocol


async def first_and_rest(stream: AsyncGenerator[Delta, None]) -> AsyncGenerator[Delta, None]:
    """Pull the first delta now (prefill and validation happen before any byte is sent)."""
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        first = None
    except BaseException:
        await stream.aclose()
        raise

    async def rest() -> AsyncGenerator[Delta, None]:
        try:
            if first is not None:
                yield first
            async for d in stream:
                yield d
        finally:
            await stream.aclose()

    return rest()


async def chat_events(
    head: protocol.ResponseHead,
    deltas: AsyncGenerator[Delta, None],
    req: protocol.ChatCompletionRequest,
    usage: Callable[[int], dict[str, int]],
    trailer: Callable[[], dict[str, Any]] | None = None,
    settle: Callable[[dict[str, int]], None] | None = None,
) -> AsyncGenerator[dict[str, Any], None]:
    """Chat chunks: the role, the deltas, then (if asked) usage and an ensemble's trace on a last chunk.
    ``settle`` gets the usage when the stream ends, however it ends (token accounting)."""
    usage_null = {"usage": None} if req.include_usage else {}
    for i in range(req.n):
        yield {**protocol.chat_chunk(head, None, index=i), **usage_null}
    completion = 0
    held: dict[int, list[Delta]] = {}  # with tools: a choice's deltas until it is known whether it calls
    tools, logprobs = req.tool_set, req.logprobs  # read once: a pydantic private attribute is slow per token
    try:
        async for d in deltas:
            completion += len(d.token_ids)
            if tools is not None:
                held.setdefault(d.index, []).append(d)
                if d.finish_reason:
                    for chunk in protocol.chat_tool_chunks(head, held.pop(d.index), tools, logprobs):
                        yield {**chunk, **usage_null}
            elif d.text or d.finish_reason or (logprobs and d.logprobs):
                yield {**protocol.chat_chunk(head, d, logprobs=logprobs), **usage_null}
    finally:
        await deltas.aclose()  # frees the sessions now, not at GC
        if settle is not None:
            settle(usage(completion))
    last = {**({"usage": usage(completion)} if req.include_usage else {}), **(trailer() if trailer else {})}
    if last:
        yield {**head.base("chat.completion.chunk"), "choices": [], **last}


async def completion_events(head: protocol.ResponseHead, streams: list[AsyncGenerator[Delta, None]], echoes: list[str],
                            req: protocol.CompletionRequest, usage: Callable[[int], dict[str, int]],
                            trailer: Callable[[], dict[str, Any]] | None = None,
                            settle: Callable[[dict[str, int]], None] | None = None,
                            scored: list[dict[str, Any]] | None = None) -> AsyncGenerator[dict[str, Any], None]:
    """Text-completion chunks of several prompts' streams, interleaved as they come; an echo chunk first per
    choice (with the prompt's token logprobs when ``scored``)."""
    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

    async def pump(p: int, s: AsyncGenerator[Delta, None]) -> None:
        try:
            async for d in s:
                queue.put_nowait((p, d))
            queue.put_nowait((p, None))
        except GatewayError as exc:
            queue.put_nowait((p, exc))
        finally:
            await s.aclose()

    tasks = [asyncio.create_task(pump(p, s)) for p, s in enumerate(streams)]
    # OpenAI's schema for completion chunks (CreateCompletionResponse) has no null usage: the field is left out
    # until the last chunk (chat chunks carry "usage": null, as their schema says)
    completion, done = 0, 0
    try:
        for p, echo in enumerate(echoes):
            for i in range(req.n if echo else 0):
                yield {
                    **head.base("text_completion"),
                    "choices": [protocol.completion_choice(p * req.n + i, echo, None, scored[p] if scored else None)],
                }
        while done < len(tasks):
            p, item = await queue.get()
            if item is None:
                done += 1
                continue
            if isinstance(item, BaseException):
                raise item
            completion += len(item.token_ids)
            lps = protocol.completion_logprobs(item.logprobs) if req.logprobs is not None else None
            yield {**head.base("text_completion"),
                   "choices": [protocol.completion_choice(p * req.n + item.index, item.text, item.finish_reason, lps)]}
        last = {**({"usage": usage(completion)} if req.include_usage else {}), **(trailer() if trailer else {})}
        if last:
            yield {**head.base("text_completion"), "choices": [], **last}
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if settle is not None:
            settle(usage(completion))
