"""The OpenAI routes: each resolves the model (an engine or an ensemble), builds the request and formats the result."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from chorus.engines.core.base import CACHE_SALT, EMBEDDINGS, TOOLS, ChoiceScorer, Engine, GenerationRequest
from chorus.errors import InvalidRequest
from chorus.server import ensemble_calls, protocol, tracing
from chorus.server.replies import ReplyPlan, ReplyShape, chat_reply, completion_reply, nothing, nothing_streamed
from chorus.server.resolve import engines, ensembles, model_for, not_found, visible
from chorus.server.streaming import until_disconnect

router = APIRouter()


def model_card(request: Request, name: str) -> dict[str, Any]:
    """OpenAI's model object, plus chorus's ``kind`` (language_model, scorer, ensemble) and ``capabilities``."""
    card: dict[str, Any] = {"id": name, "object": "model", "created": request.app.state.started, "owned_by": "chorus"}
    if name in ensembles(request):
        e = ensembles(request)[name]
        card["kind"] = "ensemble"
        card["ensemble"] = {"strategy": e.spec.strategy, "members": [m.label for m in e.strategy.members],
                            "description": e.description}
    else:
        engine = engines(request)[name]
        card["kind"] = "scorer" if isinstance(engine, ChoiceScorer) else (
            "embedding" if EMBEDDINGS in engine.capabilities else "language_model")
        card["capabilities"] = sorted(engine.capabilities)
        spec = next((m for m in request.app.state.config.models if m.name == name), None)
        if spec is not None and spec.description:
            card["description"] = spec.description
        if EMBEDDINGS in engine.capabilities:
            card["embedding"] = getattr(engine, "description", {})
        if TOOLS in engine.capabilities:  # how functions reach it: its own template, or chorus's JSON fallback
            card["tool_format"] = "native" if engine.tokenizer.supports_tools else "json"
        if isinstance(engine, ChoiceScorer):
            card["scorer"] = engine.description
        price = request.app.state.config.prices.get(name)
        if price is not None:  # the config's price table (per million tokens): budgets, and the playground's cost
            card["pricing"] = {"prompt": price.prompt, "completion": price.completion, "per_tokens": 1_000_000}
    return card


def apply_limits(request: Request, req: protocol.ChatCompletionRequest | protocol.CompletionRequest) -> None:
    limits = request.app.state.config.server.limits
    if isinstance(req, protocol.ChatCompletionRequest) and len(req.messages) > limits.max_messages:
        raise InvalidRequest(f"At most {limits.max_messages} messages per request on this server.", param="messages")
    if req.n > limits.max_n:
        raise InvalidRequest(f"'n' must be at most {limits.max_n} on this server.", param="n")
    max_tokens = req.completion_limit
    if limits.max_tokens is not None and max_tokens is not None and max_tokens > limits.max_tokens:
        raise InvalidRequest(f"'max_tokens' must be at most {limits.max_tokens} on this server.", param="max_tokens")


def fingerprint(engine: Engine) -> str:
    return "fp_" + engine.tokenizer.fingerprint[:10]


@router.get("/health", response_model=None)
async def health(request: Request) -> dict[str, Any] | JSONResponse:
    body = {"status": "ok", "models": {n: e.stats() for n, e in engines(request).items()},
            "ensembles": sorted(ensembles(request)), "inflight": request.app.state.admission.inflight}
    if request.app.state.admission.draining:  # load balancers stop sending; in-flight requests finish
        return JSONResponse({**body, "status": "draining"}, status_code=503)
    return body


@router.get("/metrics")
async def metrics() -> Response:
    """Prometheus exposition: ensemble requests, router decisions, cascade steps."""
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    """The models and named ensembles this key may use (every one without an allow-list)."""
    return {"object": "list", "data": [model_card(request, n) for n in visible(request)]}


@router.get("/v1/models/{name:path}")
async def get_model(name: str, request: Request) -> dict[str, Any]:
    if name not in visible(request):  # another key's model is as absent as an unknown one
        raise not_found(request, name)
    return model_card(request, name)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(req: protocol.ChatCompletionRequest, request: Request) -> Response:
    return await chat(request, req)


async def chat(request: Request, req: protocol.ChatCompletionRequest, shape: ReplyShape | None = None) -> Response:
    """A chat request, answered in OpenAI's shape or in another API's (``shape``: the Responses API's)."""
    apply_limits(request, req)
    CACHE_SALT.set(req.cache_salt)
    tracing.request_attributes(req.model, req.completion_limit, req.temperature)
    ensemble = ensemble_calls.find_ensemble(request, req)
    if ensemble is not None:
        if req.continue_final_message:
            raise InvalidRequest("'continue_final_message' is served on one model, not on an ensemble.",
                                 param="continue_final_message")
        return await ensemble_calls.chat(request, req, ensemble, shape)
    engine = model_for(request, req.model, body=req, generates=True)
    gen_req = req.to_generation_request(engine)
    work = ReplyPlan(
        [lambda: engine.generate(gen_req)],
        [lambda: engine.stream(gen_req)],
        usage=lambda completion: protocol.usage(len(gen_req.prompt_ids), completion, gen_req.cached_tokens),
        trailer=trace_of([gen_req]),
    )
    return await chat_reply(request, req, protocol.ResponseHead("chatcmpl", req.model, fingerprint(engine)), work,
                            shape)


@router.post("/v1/completions", response_model=None)
async def completions(req: protocol.CompletionRequest, request: Request) -> Response:
    apply_limits(request, req)
    tracing.request_attributes(req.model, req.max_tokens, req.temperature, "text_completion")
    CACHE_SALT.set(req.cache_salt)
    ensemble = ensemble_calls.find_ensemble(request, req)
    if ensemble is not None:
        return await ensemble_calls.completion(request, req, ensemble)
    engine = model_for(request, req.model, body=req, generates=True)
    gen_reqs = req.to_generation_requests(engine)
    prompt_tokens = sum(len(g.prompt_ids) for g in gen_reqs)
    echo_only = req.max_tokens == 0  # the prompt is scored, nothing is generated
    work = ReplyPlan([functools.partial(nothing, g, req.n) if echo_only else functools.partial(engine.generate, g)
                 for g in gen_reqs],
                [functools.partial(nothing_streamed, req.n) if echo_only else functools.partial(engine.stream, g)
                 for g in gen_reqs],
                usage=lambda completion: protocol.usage(prompt_tokens, completion,
                                                        sum(g.cached_tokens for g in gen_reqs)),
                trailer=trace_of(gen_reqs))
    echoes = [engine.tokenizer.decode(g.prompt_ids) if req.echo else "" for g in gen_reqs]
    scored = None
    if req.echo and req.logprobs is not None:  # log-likelihood scoring: every prompt token's logprob
        k = req.logprobs
        lps = await until_disconnect(request, asyncio.gather(*(engine.prompt_logprobs(g.prompt_ids, k)
                                                               for g in gen_reqs)))
        scored = [protocol.prompt_logprobs([engine.tokenizer.decode([t]) for t in g.prompt_ids], lp)
                  for g, lp in zip(gen_reqs, lps)]
    return await completion_reply(
        request, req, protocol.ResponseHead("cmpl", req.model, fingerprint(engine)), work, echoes, scored
    )


def trace_of(gen_reqs: list[GenerationRequest]) -> Callable[[], dict[str, Any]]:
    """The ``trace`` trailer (``"trace": true``): one prompt's is an object, several prompts' a list."""
    if gen_reqs[0].trace is None:
        return dict
    return lambda: {"trace": gen_reqs[0].trace if len(gen_reqs) == 1 else [g.trace for g in gen_reqs]}
