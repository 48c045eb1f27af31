"""Requests answered by an ensemble: resolve it (named, or from the body), admit it, run it.

The strategy's work is its own (ensembles/); this module turns a request into a `Call` and hands the
call to the response tail single models use too (``replies.py``). ``usage`` sums every member call; with
``"trace": true`` the response carries an ``ensemble`` object (streams: on a last chunk with no choices).
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any, Protocol

from fastapi import Request
from pydantic import ValidationError
from starlette.responses import Response

from chorus.config import Limits
from chorus.ensembles.base import Ensemble
from chorus.ensembles.call import Call, Prompt
from chorus.ensembles.spec import EnsembleSpec
from chorus.errors import InvalidRequest
from chorus.server import protocol
from chorus.server.replies import ReplyPlan, ReplyShape, chat_reply, completion_reply, nothing, nothing_streamed
from chorus.server.resolve import ensemble_for, served_of
from chorus.server.streaming import until_disconnect


class AsksModel(Protocol):
    """A request body that names a model and may carry an ``ensemble`` (chat, completions, choices)."""

    model: str
    ensemble: dict[str, Any] | None


def find_ensemble(request: Request, req: AsksModel) -> Ensemble | None:
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
    if base is not None and set(req.ensemble) <= {"trace"}:  # the same ensemble, its trace asked for: no rebuild
        return Ensemble(spec, base.strategy)  # (an online router's learned state lives in its strategy)
    return Ensemble.build(spec, request.app.state.engines, name=req.model if base is not None else None)


def fingerprint(ensemble: Ensemble) -> str:
    spec = json.dumps(ensemble.spec.model_dump(exclude={"trace"}), sort_keys=True, default=str)
    return "fp_ens_" + hashlib.sha256(spec.encode()).hexdigest()[:8]


def start_call(
    ensemble: Ensemble, req: protocol.ChatCompletionRequest | protocol.CompletionRequest, prompt: Prompt
) -> Call:
    return ensemble.call(prompt, req.sampling_params, n=req.n, logprobs=req.wants_logprobs)


def charge_members(request: Request, call: Call) -> None:
    """The key is charged per member model (what each member call used), not for the ensemble's name."""
    def used() -> dict[str, tuple[int, int]]:
        by_label = {m.label: m.spec.model for m in call.members}
        out: dict[str, tuple[int, int]] = {}
        for label, u in call.by_member.items():
            model = by_label.get(label, label)
            p, c = out.get(model, (0, 0))
            out[model] = (p + u.prompt_tokens, c + u.completion_tokens)
        return out

    served = served_of(request)
    served.member_usage = used
    served.decision = lambda: call.decision  # an online router's, for feedback (server/feedback.py)


def work_of(ensemble: Ensemble, call: Call) -> ReplyPlan:
    """The call as the response tail's work. ``usage`` sums every member call; token-level strategies
    produce their first token before the first byte is sent (so their errors are HTTP errors), text-level
    ones start the SSE stream at once (pings keep it open while members work) and report a failure as the
    final error event. With ``"trace": true`` the response carries an ``ensemble`` object."""
    return ReplyPlan([lambda: ensemble.run(call)], [lambda: ensemble.stream(call)],
                usage=lambda _completion: protocol.usage(call.usage.prompt_tokens, call.usage.completion_tokens,
                                                         call.usage.cached_tokens),
                trailer=lambda: {"ensemble": call.final_trace()} if ensemble.spec.trace else {},
                prefetch=ensemble.strategy.token_level)


def admit(request: Request, req: AsksModel, ensemble: Ensemble) -> None:
    """The key's allow-list (a named ensemble is one name; an inline one is every model it uses) and the
    server's ensemble limits."""
    ensemble_for(request, req.model, ensemble, body=req)
    check_limits(request.app.state.config.server.limits, ensemble)


def check_limits(limits: Limits, ensemble: Ensemble) -> None:
    members = len(ensemble.strategy.members)
    if members > limits.max_members:
        raise InvalidRequest(f"At most {limits.max_members} ensemble members on this server (got {members}).",
                             param="ensemble.members")
    budget = ensemble.strategy.budget()
    if budget.rounds > limits.max_rounds:
        raise InvalidRequest(f"'max_rounds' must be at most {limits.max_rounds} on this server.",
                             param="ensemble.max_rounds")
    if budget.candidates > limits.max_candidates:
        raise InvalidRequest(f"At most {limits.max_candidates} candidates (given or sampled) per ensemble request on this server "
                             f"(got {budget.candidates}).", param="ensemble.candidates")


async def chat(request: Request, req: protocol.ChatCompletionRequest, ensemble: Ensemble,
               shape: ReplyShape | None = None) -> Response:
    admit(request, req, ensemble)
    call = start_call(ensemble, req, Prompt(messages=req.message_dicts()))
    charge_members(request, call)
    return await chat_reply(request, req, protocol.ResponseHead("chatcmpl", req.model, fingerprint(ensemble)),
                            work_of(ensemble, call), shape)


async def completion(request: Request, req: protocol.CompletionRequest, ensemble: Ensemble) -> Response:
    prompts = req.prompts()
    if len(prompts) != 1 or not isinstance(prompts[0], str):
        raise InvalidRequest("With an ensemble, 'prompt' must be one string (members may tokenize differently).",
                             param="prompt")
    admit(request, req, ensemble)
    call = start_call(ensemble, req, Prompt(text=prompts[0]))
    charge_members(request, call)
    work, scored = work_of(ensemble, call), None
    if req.echo and (req.logprobs is not None or req.max_tokens == 0):  # score the prompt under the ensemble
        tokens, lps = await until_disconnect(request, ensemble.strategy.prompt_logprobs(call, req.logprobs or 0))
        if req.logprobs is not None:
            scored = [protocol.prompt_logprobs(tokens, lps)]
        if req.max_tokens == 0:
            first = call.request(ensemble.strategy.members[0])
            work = ReplyPlan([functools.partial(nothing, first, req.n, call.usage.prompt_tokens)],
                        [functools.partial(nothing_streamed, req.n)],
                        usage=work.usage, trailer=work.trailer)
    return await completion_reply(request, req, protocol.ResponseHead("cmpl", req.model, fingerprint(ensemble)),
                                  work, [prompts[0] if req.echo else ""], scored)
