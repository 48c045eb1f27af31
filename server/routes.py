"""The OpenAI routes: each resolves the model, builds a GenerationRequest and formats the result."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engines.base import Delta, Engine
from engines.errors import GatewayError, InvalidRequest, ModelNotFound
from engines.generation import check_context
from server import protocol as P
from server.streaming import sse_response, until_disconnect

router = APIRouter()


def engines(request: Request) -> dict[str, Engine]:
    return request.app.state.engines


def resolve(request: Request, name: str) -> Engine:
    found = engines(request).get(name)
    if found is None:
        known = ", ".join(sorted(engines(request))) or "none"
        raise ModelNotFound(f"The model '{name}' does not exist. Available models: {known}.", param="model")
    return found


def apply_limits(request: Request, req: P._Sampling) -> None:
    limits = request.app.state.config.server.limits
    if req.n > limits.max_n:
        raise InvalidRequest(f"'n' must be at most {limits.max_n} on this server.", param="n")
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
    if limits.max_tokens is not None and max_tokens is not None and max_tokens > limits.max_tokens:
        raise InvalidRequest(f"'max_tokens' must be at most {limits.max_tokens} on this server.", param="max_tokens")


def fingerprint(engine: Engine) -> str:
    return "fp_" + engine.tokenizer.fingerprint[:10]


async def first_and_rest(stream: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    """Pull the first delta now (prefill and validation happen before any byte is sent)."""
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        first = None
    except BaseException:
        await stream.aclose()  # type: ignore[attr-defined]
        raise

    async def rest() -> AsyncIterator[Delta]:
        try:
            if first is not None:
                yield first
            async for d in stream:
                yield d
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    return rest()


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    return {"status": "ok",
            "models": {n: e.stats() for n, e in engines(request).items()}}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    created = request.app.state.started
    return {"object": "list", "data": [{"id": n, "object": "model", "created": created, "owned_by": "chorus"}
                                        for n in engines(request)]}


@router.get("/v1/models/{name:path}")
async def get_model(name: str, request: Request) -> dict[str, Any]:
    resolve(request, name)
    return {"id": name, "object": "model", "created": request.app.state.started, "owned_by": "chorus"}


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(req: P.ChatCompletionRequest, request: Request) -> Response | dict[str, Any]:
    engine = resolve(request, req.model)
    apply_limits(request, req)
    ids = engine.tokenizer.encode_chat(req.message_dicts())
    gen_req = req.to_generation_request(ids, extra_stop=engine.tokenizer.chat_stop, defaults=engine.sampling_defaults)
    check_context(len(ids), gen_req.params, engine.max_model_len)
    head = P.ResponseHead("chatcmpl", req.model, fingerprint(engine))
    if not req.stream:
        gen = await until_disconnect(request, engine.generate(gen_req))
        return P.chat_response(head, gen)
    deltas = await until_disconnect(request, first_and_rest(engine.stream(gen_req)))
    return sse_response(chat_events(head, deltas, req, len(ids)))


async def chat_events(head: P.ResponseHead, deltas: AsyncIterator[Delta], req: P.ChatCompletionRequest,
                      prompt_tokens: int) -> AsyncIterator[dict[str, Any]]:
    usage_null = {"usage": None} if req.include_usage else {}
    for i in range(req.n):
        yield {**P.chat_chunk(head, None, index=i), **usage_null}
    completion = 0
    try:
        async for d in deltas:
            completion += len(d.token_ids)
            if d.text or d.finish_reason or (req.logprobs and d.logprobs):
                yield {**P.chat_chunk(head, d, logprobs=req.logprobs), **usage_null}
    finally:
        await deltas.aclose()  # type: ignore[attr-defined]  # frees the sessions now, not at GC
    if req.include_usage:
        yield {**head.base("chat.completion.chunk"), "choices": [], "usage": P.usage(prompt_tokens, completion)}


@router.post("/v1/completions", response_model=None)
async def completions(req: P.CompletionRequest, request: Request) -> Response | dict[str, Any]:
    engine = resolve(request, req.model)
    apply_limits(request, req)
    prompts = [engine.tokenizer.encode(p) if isinstance(p, str) else p for p in req.prompts()]
    vocab = engine.tokenizer.vocab_size
    for i, ids in enumerate(prompts):
        if any(t < 0 or t >= vocab for t in ids):
            raise InvalidRequest(f"prompt {i} holds token ids outside the vocabulary (0..{vocab - 1}).", param="prompt")
    gen_reqs = [req.to_generation_request(ids, defaults=engine.sampling_defaults) for ids in prompts]
    for g in gen_reqs:
        check_context(len(g.prompt_ids), g.params, engine.max_model_len)
    head = P.ResponseHead("cmpl", req.model, fingerprint(engine))
    echoes = [engine.tokenizer.decode(ids) if req.echo else "" for ids in prompts]
    if not req.stream:
        gens = await until_disconnect(request, asyncio.gather(*(engine.generate(g) for g in gen_reqs)))
        choices = []
        for p, gen in enumerate(gens):
            for c in gen.choices:
                lps = P.completion_logprobs(c.logprobs, len(echoes[p])) if c.logprobs is not None else None
                choices.append(P.completion_choice(p * req.n + c.index, echoes[p] + c.text, c.finish_reason, lps))
        return P.completion_response(head, choices, sum(g.prompt_tokens for g in gens),
                                     sum(g.completion_tokens for g in gens))
    opened = await until_disconnect(request, asyncio.gather(
        *(first_and_rest(engine.stream(g)) for g in gen_reqs), return_exceptions=True))
    streams = [s for s in opened if not isinstance(s, BaseException)]
    failed = [s for s in opened if isinstance(s, BaseException)]
    if failed:  # prompts are prefilled together; if one fails, close the others and report it
        for s in streams:
            await s.aclose()  # type: ignore[attr-defined]
        raise failed[0]
    return sse_response(completion_events(head, streams, echoes, req, sum(len(p) for p in prompts)))


async def completion_events(head: P.ResponseHead, streams: list[AsyncIterator[Delta]], echoes: list[str],
                            req: P.CompletionRequest, prompt_tokens: int) -> AsyncIterator[dict[str, Any]]:
    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

    async def pump(p: int, s: AsyncIterator[Delta]) -> None:
        try:
            async for d in s:
                queue.put_nowait((p, d))
            queue.put_nowait((p, None))
        except GatewayError as exc:
            queue.put_nowait((p, exc))
        finally:
            await s.aclose()  # type: ignore[attr-defined]

    tasks = [asyncio.create_task(pump(p, s)) for p, s in enumerate(streams)]
    usage_null = {"usage": None} if req.include_usage else {}
    completion, done = 0, 0
    try:
        for p, echo in enumerate(echoes):
            for i in range(req.n if echo else 0):
                yield {**head.base("text_completion"), **usage_null,
                       "choices": [P.completion_choice(p * req.n + i, echo, None, None)]}
        while done < len(tasks):
            p, item = await queue.get()
            if item is None:
                done += 1
                continue
            if isinstance(item, BaseException):
                raise item
            completion += len(item.token_ids)
            lps = P.completion_logprobs(item.logprobs) if req.logprobs is not None else None
            yield {**head.base("text_completion"), **usage_null,
                   "choices": [P.completion_choice(p * req.n + item.index, item.text, item.finish_reason, lps)]}
        if req.include_usage:
            yield {**head.base("text_completion"), "choices": [], "usage": P.usage(prompt_tokens, completion)}
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


