"""OpenAI's chat and completion replies: usage, logprobs, whole responses, and streams (engine deltas -> chat or
text-completion chunks)."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from chorus.engines.core import tool_calls
from chorus.engines.core.base import Choice, Delta, Generation, TokenLogprob, Tools
from chorus.errors import GatewayError
from chorus.server.wire import request as wire


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens`` (chat and completions): prompt tokens the engine's prefix cache
    served, as ``prompt_tokens_details.cached_tokens``."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def chat_logprobs(lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if lps is None:
        return None
    return {"content": [
        {"token": lp.token, "logprob": lp.logprob, "bytes": lp.bytes,
         "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in lp.top]}
        for lp in lps], "refusal": None}


def completion_logprobs(lps: list[TokenLogprob] | None, offset: int = 0) -> dict[str, Any] | None:
    if lps is None:
        return None
    offsets, pos = [], offset
    for lp in lps:
        offsets.append(pos)
        pos += len(lp.token)
    return {"tokens": [lp.token for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{t.token: t.logprob for t in lp.top} for lp in lps], "text_offset": offsets}


def prompt_logprobs(tokens: list[str], lps: list[TokenLogprob | None]) -> dict[str, Any]:
    """The echoed prompt's logprobs as vLLM returns them: every prompt token, ``null`` for the first."""
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob if lp is not None else None for lp in lps],
            "top_logprobs": [{t.token: t.logprob for t in lp.top} if lp is not None else None for lp in lps],
            "text_offset": offsets}


def joined_logprobs(prompt: dict[str, Any] | None, completion: dict[str, Any] | None) -> dict[str, Any] | None:
    """An echoed prompt's logprobs followed by the completion's (offsets already continue the echo)."""
    if prompt is None or completion is None:
        return completion if prompt is None else prompt
    return {k: prompt[k] + completion[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


class ResponseHead:
    """id / created / model / system_fingerprint, the same on every chunk of one response."""

    def __init__(self, prefix: str, model: str, fingerprint: str) -> None:
        self.id = new_id(prefix)
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint

    def base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}


def chat_response(head: ResponseHead, gen: Generation, offered: Tools | None = None) -> dict[str, Any]:
    """``offered``: the functions the model could call; a choice that calls them gets ``tool_calls``."""
    def choice(c: Choice) -> dict[str, Any]:
        message, finish = assistant_message(c.text, c.finish_reason, offered)
        out = {"index": c.index, "message": message, "logprobs": chat_logprobs(c.logprobs), "finish_reason": finish}
        return {**out, "stop_reason": c.stop} if c.stop is not None and finish == "stop" else out

    return {**head.base("chat.completion"), "choices": [choice(c) for c in gen.choices],
            "usage": usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)}


def chat_chunk(head: ResponseHead, delta: Delta | None, *, index: int = 0,
               logprobs: bool = False) -> dict[str, Any]:
    if delta is None:  # the opening chunk that carries the role
        body: dict[str, Any] = {"role": "assistant", "content": ""}
        ch = {"index": index, "delta": body, "logprobs": None, "finish_reason": None}
    else:
        body = {"content": delta.text} if delta.text or not delta.finish_reason else {}
        ch = {"index": delta.index, "delta": body,
              "logprobs": chat_logprobs(delta.logprobs) if logprobs else None,
              "finish_reason": delta.finish_reason}
        if delta.stop is not None:
            ch["stop_reason"] = delta.stop  # vLLM's field: the stop string that ended the choice
    return {**head.base("chat.completion.chunk"), "choices": [ch]}


def chat_tool_chunks(head: ResponseHead, deltas: list[Delta], offered: Tools, logprobs: bool) -> list[dict[str, Any]]:
    """One choice's chunks when functions were offered: its whole text is parsed first, then sent as
    ``tool_calls`` (each call whole in one delta, as OpenAI's last argument chunk completes it) or as content."""
    index, finish = deltas[-1].index, deltas[-1].finish_reason or "stop"
    text = "".join(d.text for d in deltas)
    message, finish = assistant_message(text, finish, offered)
    lps = chat_logprobs([lp for d in deltas for lp in d.logprobs]) if logprobs else None
    delta: dict[str, Any] = {"content": message["content"]} if message["content"] else {}
    if "tool_calls" in message:
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
    base = head.base("chat.completion.chunk")
    last: dict[str, Any] = {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}
    if deltas[-1].stop is not None and finish == "stop":
        last["stop_reason"] = deltas[-1].stop
    return [{**base, "choices": [{"index": index, "delta": delta, "logprobs": lps, "finish_reason": None}]},
            {**base, "choices": [last]}]


def completion_response(head: ResponseHead, choices: list[dict[str, Any]], prompt_tokens: int,
                        completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {**head.base("text_completion"), "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def assistant_message(text: str, finish_reason: str, tools: Tools | None) -> tuple[dict[str, Any], str]:
    """The assistant message for a choice's text, and its finish reason (``tool_calls`` when it calls)."""
    if tools is None:
        return {"role": "assistant", "content": text, "refusal": None}, finish_reason
    content, calls = tool_calls.parse(text, tools, cut=finish_reason == "length")
    if not calls:
        return {"role": "assistant", "content": content, "refusal": None}, finish_reason
    msg = {"role": "assistant", "content": content, "refusal": None, "tool_calls": [c.as_openai() for c in calls]}
    return msg, "tool_calls" if finish_reason == "stop" else finish_reason


# ---- streams ----

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
    head: ResponseHead,
    deltas: AsyncGenerator[Delta, None],
    req: wire.ChatCompletionRequest,
    usage: Callable[[int], dict[str, int]],
    trailer: Callable[[], dict[str, Any]] | None = None,
    settle: Callable[[dict[str, int]], None] | None = None,
) -> AsyncGenerator[dict[str, Any], None]:
    """Chat chunks: the role, the deltas, then (if asked) usage and an ensemble's trace on a last chunk.
    ``settle`` gets the usage when the stream ends, however it ends (token accounting)."""
    usage_null = {"usage": None} if req.include_usage else {}
    for i in range(req.n):
        yield {**chat_chunk(head, None, index=i), **usage_null}
    completion = 0
    held: dict[int, list[Delta]] = {}  # with tools: a choice's deltas until it is known whether it calls
    tools, logprobs = req.tool_set, req.logprobs  # read once: a pydantic private attribute is slow per token
    try:
        async for d in deltas:
            completion += len(d.token_ids)
            if tools is not None:
                held.setdefault(d.index, []).append(d)
                if d.finish_reason:
                    for chunk in chat_tool_chunks(head, held.pop(d.index), tools, logprobs):
                        yield {**chunk, **usage_null}
            elif d.text or d.finish_reason or (logprobs and d.logprobs):
                yield {**chat_chunk(head, d, logprobs=logprobs), **usage_null}
    finally:
        await deltas.aclose()  # frees the sessions now, not at GC
        if settle is not None:
            settle(usage(completion))
    last = {**({"usage": usage(completion)} if req.include_usage else {}), **(trailer() if trailer else {})}
    if last:
        yield {**head.base("chat.completion.chunk"), "choices": [], **last}


async def completion_events(head: ResponseHead, streams: list[AsyncGenerator[Delta, None]], echoes: list[str],
                            req: wire.CompletionRequest, usage: Callable[[int], dict[str, int]],
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
                    "choices": [completion_choice(p * req.n + i, echo, None, scored[p] if scored else None)],
                }
        while done < len(tasks):
            p, item = await queue.get()
            if item is None:
                done += 1
                continue
            if isinstance(item, BaseException):
                raise item
            completion += len(item.token_ids)
            lps = completion_logprobs(item.logprobs) if req.logprobs is not None else None
            yield {**head.base("text_completion"),
                   "choices": [completion_choice(p * req.n + item.index, item.text, item.finish_reason, lps)]}
        last = {**({"usage": usage(completion)} if req.include_usage else {}), **(trailer() if trailer else {})}
        if last:
            yield {**head.base("text_completion"), "choices": [], **last}
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if settle is not None:
            settle(usage(completion))
