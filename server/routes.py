"""The OpenAI routes: each resolves the model (an engine or an ensemble), builds the request and formats the result."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic_core import to_json

from chorus.engines.base import Engine
from chorus.engines.generation import check_context
from chorus.ensembles.base import Ensemble
from chorus.errors import InvalidRequest, ModelNotFound
from chorus.server import ensemble_calls
from chorus.server import protocol as P
from chorus.server.accounting import first_token, served_by, settle
from chorus.server.events import chat_events, completion_events, first_and_rest
from chorus.server.streaming import sse_response, until_disconnect

router = APIRouter()


def engines(request: Request) -> dict[str, Engine]:
    return request.app.state.engines


def ensembles(request: Request) -> dict[str, Ensemble]:
    return request.app.state.ensembles


def resolve(request: Request, name: str) -> Engine:
    found = engines(request).get(name)
    if found is None:
        known = ", ".join(sorted([*engines(request), *ensembles(request)])) or "none"
        raise ModelNotFound(f"The model '{name}' does not exist. Available models: {known}.", param="model")
    return found


def model_card(request: Request, name: str) -> dict[str, Any]:
    card = {"id": name, "object": "model", "created": request.app.state.started, "owned_by": "chorus"}
    if name in ensembles(request):
        e = ensembles(request)[name]
        card["ensemble"] = {"strategy": e.spec.strategy, "members": [m.label for m in e.strategy.members],
                            "description": getattr(e.spec, "description", None)}
    return card


def apply_limits(request: Request, req: P._Sampling) -> None:
    limits = request.app.state.config.server.limits
    if isinstance(req, P.ChatCompletionRequest) and len(req.messages) > limits.max_messages:
        raise InvalidRequest(f"At most {limits.max_messages} messages per request on this server.", param="messages")
    if req.n > limits.max_n:
        raise InvalidRequest(f"'n' must be at most {limits.max_n} on this server.", param="n")
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
    if limits.max_tokens is not None and max_tokens is not None and max_tokens > limits.max_tokens:
        raise InvalidRequest(f"'max_tokens' must be at most {limits.max_tokens} on this server.", param="max_tokens")


def json_response(body: dict[str, Any]) -> Response:
    """A finished response body as JSON bytes (pydantic-core's encoder): skips FastAPI's jsonable_encoder
    walk and the stdlib json.dumps, a measurable share of a non-streamed request (chorus bench gateway)."""
    return Response(to_json(body), media_type="application/json")


def fingerprint(engine: Engine) -> str:
    return "fp_" + engine.tokenizer.fingerprint[:10]


@router.get("/health", response_model=None)
async def health(request: Request) -> dict[str, Any] | JSONResponse:
    body = {"status": "ok", "models": {n: e.stats() for n, e in engines(request).items()},
            "ensembles": sorted(ensembles(request)), "inflight": request.app.state.door.inflight}
    if request.app.state.door.draining:  # load balancers stop sending; in-flight requests finish
        return JSONResponse({**body, "status": "draining"}, status_code=503)
    return body


@router.get("/metrics")
async def metrics() -> Response:
    """Prometheus exposition: ensemble requests, router decisions, cascade steps."""
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(request, n) for n in [*engines(request), *ensembles(request)]]}


@router.get("/v1/models/{name:path}")
async def get_model(name: str, request: Request) -> dict[str, Any]:
    if name not in ensembles(request):
        resolve(request, name)
    return model_card(request, name)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(req: P.ChatCompletionRequest, request: Request) -> Response | dict[str, Any]:
    apply_limits(request, req)
    ensemble = ensemble_calls.find_ensemble(request, req)
    if ensemble is not None:
        return await ensemble_calls.chat(request, req, ensemble)
    engine = resolve(request, req.model)
    served_by(request, req.model, body=req)
    messages = req.message_dicts()
    ids = engine.tokenizer.encode_chat(messages)
    gen_req = req.to_generation_request(ids, extra_stop=engine.tokenizer.chat_stop, defaults=engine.sampling_defaults,
                                        messages=messages)
    check_context(len(ids), gen_req.params, engine.max_model_len)
    head = P.ResponseHead("chatcmpl", req.model, fingerprint(engine))
    trailer = (lambda: {"trace": gen_req.trace}) if gen_req.trace is not None else None
    if not req.stream:
        gen = await until_disconnect(request, engine.generate(gen_req))
        body = {**P.chat_response(head, gen), **(trailer() if trailer else {})}
        settle(request, req.model, body["usage"])
        return json_response(body)
    deltas = await until_disconnect(request, first_and_rest(engine.stream(gen_req)))
    first_token(request, req.model)
    return sse_response(chat_events(head, deltas, req, lambda completion: P.usage(len(ids), completion),
                                    trailer=trailer, settle=lambda u: settle(request, req.model, u)), request)


@router.post("/v1/completions", response_model=None)
async def completions(req: P.CompletionRequest, request: Request) -> Response | dict[str, Any]:
    apply_limits(request, req)
    ensemble = ensemble_calls.find_ensemble(request, req)
    if ensemble is not None:
        return await ensemble_calls.completion(request, req, ensemble)
    engine = resolve(request, req.model)
    served_by(request, req.model, body=req)
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
    # the trace of one prompt is an object; of several, a list in prompt order
    trailer = None if not req.trace else (lambda: {"trace": gen_reqs[0].trace if len(gen_reqs) == 1
                                                   else [g.trace for g in gen_reqs]})
    if not req.stream:
        gens = await until_disconnect(request, asyncio.gather(*(engine.generate(g) for g in gen_reqs)))
        choices = []
        for p, gen in enumerate(gens):
            for c in gen.choices:
                lps = P.completion_logprobs(c.logprobs, len(echoes[p])) if c.logprobs is not None else None
                choices.append(P.completion_choice(p * req.n + c.index, echoes[p] + c.text, c.finish_reason, lps))
        body = P.completion_response(head, choices, sum(g.prompt_tokens for g in gens),
                                     sum(g.completion_tokens for g in gens))
        body.update(trailer() if trailer else {})
        settle(request, req.model, body["usage"])
        return json_response(body)
    opened = await until_disconnect(request, asyncio.gather(
        *(first_and_rest(engine.stream(g)) for g in gen_reqs), return_exceptions=True))
    streams = [s for s in opened if not isinstance(s, BaseException)]
    failed = [s for s in opened if isinstance(s, BaseException)]
    if failed:  # prompts are prefilled together; if one fails, close the others and report it
        for s in streams:
            await s.aclose()  # type: ignore[attr-defined]
        raise failed[0]
    prompt_tokens = sum(len(p) for p in prompts)
    first_token(request, req.model)
    return sse_response(completion_events(head, streams, echoes, req, lambda c: P.usage(prompt_tokens, c),
                                          trailer=trailer, settle=lambda u: settle(request, req.model, u)), request)


