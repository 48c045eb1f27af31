"""Requests answered by an ensemble: resolve it (named, or from the body), run it, format the result.

The strategy's work is its own (ensembles/); this module only turns a request into a `Call` and the
`Call`'s deltas, usage and trace into OpenAI JSON or SSE. ``usage`` sums every member call; with
``"trace": true`` the response carries an ``ensemble`` object (streams: on a last chunk with no choices).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from chorus.engines.base import Delta
from chorus.ensembles.base import Call, Ensemble, Prompt
from chorus.ensembles.spec import EnsembleSpec
from chorus.errors import InvalidRequest
from chorus.server import protocol as P
from chorus.server.accounting import first_token, served_by, settle
from chorus.server.events import chat_events, completion_events, first_and_rest
from chorus.server.streaming import sse_response, until_disconnect


def find_ensemble(request: Request, req: P._Sampling) -> Ensemble | None:
    """The ensemble this request asks for: a named one (``model``), the body's ``ensemble``, or both merged."""
    named: dict[str, Ensemble] = request.app.state.ensembles
    base = named.get(req.model)
    if req.ensemble is None:
        return base
    try:
        spec = base.spec.merged(req.ensemble) if base is not None else EnsembleSpec.model_validate(req.ensemble)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise InvalidRequest(f"Invalid 'ensemble' object: {where or 'ensemble'}: {err['msg']}.",
                             param="ensemble" + (f".{where}" if where else "")) from None
    return Ensemble.build(spec, request.app.state.engines, name=req.model if base is not None else None)


def fingerprint(ensemble: Ensemble) -> str:
    spec = json.dumps(ensemble.spec.model_dump(exclude={"trace"}), sort_keys=True, default=str)
    return "fp_ens_" + hashlib.sha256(spec.encode()).hexdigest()[:8]


def start_call(ensemble: Ensemble, req: P.ChatCompletionRequest | P.CompletionRequest, prompt: Prompt) -> Call:
    return ensemble.call(prompt, req.sampling_params, n=req.n, logprobs=req.wants_logprobs)


def trailer(ensemble: Ensemble, call: Call) -> dict[str, Any]:
    return {"ensemble": call.final_trace()} if ensemble.spec.trace else {}


async def deltas_for(request: Request, ensemble: Ensemble, call: Call) -> AsyncIterator[Delta]:
    """The strategy's stream. Token-level strategies produce their first token before the first byte is
    sent (so their errors are HTTP errors); text-level ones start the SSE stream at once (pings keep it
    open while members work) and report a failure as the final error event."""
    stream = ensemble.stream(call)
    if ensemble.strategy.token_level:
        first = await until_disconnect(request, first_and_rest(stream))
        first_token(request, request.state.model)
        return first
    return stream


def usage_of(call: Call) -> Callable[[int], dict[str, int]]:
    return lambda _completion: P.usage(call.usage.prompt_tokens, call.usage.completion_tokens)


def admit(request: Request, req: P._Sampling, ensemble: Ensemble) -> None:
    """The key's allow-list (a named ensemble is one name; an inline one is every model it uses) and the
    server's ensemble limits."""
    named = req.model in request.app.state.ensembles
    served_by(request, req.model if named else f"ensemble:{ensemble.spec.strategy}", ensemble.spec.strategy,
              uses=() if named else ensemble.strategy.models(),
              body=req)
    check_limits(request.app.state.config.server.limits, ensemble)


def check_limits(limits: Any, ensemble: Ensemble) -> None:
    members = len(ensemble.strategy.members)
    if members > limits.max_members:
        raise InvalidRequest(f"At most {limits.max_members} ensemble members on this server (got {members}).",
                             param="ensemble.members")
    p = ensemble.strategy.params
    rounds = getattr(p, "max_rounds", None)
    if rounds is not None and rounds > limits.max_rounds:
        raise InvalidRequest(f"'max_rounds' must be at most {limits.max_rounds} on this server.",
                             param="ensemble.max_rounds")
    given = len(getattr(p, "candidates", None) or [])
    sampled = getattr(p, "samples_per_member", 0) * members if getattr(p, "candidates", None) is None else 0
    if max(given, sampled) > limits.max_candidates:
        raise InvalidRequest(f"At most {limits.max_candidates} crowd_vote candidates on this server "
                             f"(got {max(given, sampled)}).", param="ensemble.candidates")


async def chat(request: Request, req: P.ChatCompletionRequest, ensemble: Ensemble) -> Any:
    admit(request, req, ensemble)
    call = start_call(ensemble, req, Prompt(messages=req.message_dicts()))
    head = P.ResponseHead("chatcmpl", req.model, fingerprint(ensemble))
    if not req.stream:
        gen = await until_disconnect(request, ensemble.run(call))
        body = {**P.chat_response(head, gen), **trailer(ensemble, call)}
        settle(request, request.state.model, body["usage"])
        return body
    deltas = await deltas_for(request, ensemble, call)
    return sse_response(chat_events(head, deltas, req, usage_of(call), lambda: trailer(ensemble, call),
                                    settle=lambda u: settle(request, request.state.model, u)), request)


async def completion(request: Request, req: P.CompletionRequest, ensemble: Ensemble) -> Any:
    prompts = req.prompts()
    if len(prompts) != 1 or not isinstance(prompts[0], str):
        raise InvalidRequest("With an ensemble, 'prompt' must be one string (members may tokenize differently).",
                             param="prompt")
    admit(request, req, ensemble)
    call = start_call(ensemble, req, Prompt(text=prompts[0]))
    head = P.ResponseHead("cmpl", req.model, fingerprint(ensemble))
    echo = prompts[0] if req.echo else ""
    if not req.stream:
        gen = await until_disconnect(request, ensemble.run(call))
        choices = [P.completion_choice(c.index, echo + c.text, c.finish_reason,
                                       P.completion_logprobs(c.logprobs, len(echo)) if c.logprobs is not None else None)
                   for c in gen.choices]
        body = {**P.completion_response(head, choices, gen.prompt_tokens, gen.completion_tokens),
                **trailer(ensemble, call)}
        settle(request, request.state.model, body["usage"])
        return body
    deltas = await deltas_for(request, ensemble, call)
    return sse_response(completion_events(head, [deltas], [echo], req, usage_of(call), lambda: trailer(ensemble, call),
                                          settle=lambda u: settle(request, request.state.model, u)), request)
