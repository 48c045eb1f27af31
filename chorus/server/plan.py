"""The plan: how a resolved target (server/resolve.py) answers this API's request, before anything runs.

A `ReplyPlan` says, per prompt, how to produce the answer whole or as a stream of deltas, how the tokens are
counted, what the response's trailer holds; the reply (server/reply.py) runs it and renders it (nothing here
renders: the plan reads the request, the reply writes the response). A model's plan is
its engine's `generate` / `stream` on the request's `GenerationRequest`s; an ensemble's is a `Call` of its
strategy, whose key is charged per member model (what each member call used) rather than for the ensemble's name.
With ``"trace": true`` a model's response carries a ``trace`` trailer, an ensemble's an ``ensemble`` object.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from chorus.engines.core.base import Choice, Delta, Engine, Generation, GenerationRequest, TokenLogprob
from chorus.ensembles.base import Ensemble
from chorus.ensembles.call import Call, Prompt
from chorus.ensembles.choice_scores import ChoiceAnswer, ChoiceQuestion
from chorus.errors import InvalidRequest
from chorus.server.gateway.context import Context
from chorus.server.gateway.streaming import until_disconnect
from chorus.server.resolve import EnsembleTarget, Target
from chorus.server.wire import request as wire

#: tokens used: (prompt, completion, prompt tokens the prefix cache served, or None where it is not known)
Tokens = tuple[int, int, int | None]
#: a prompt's tokens (as text) and their logprobs (``echo`` with ``logprobs``)
Scored = tuple[list[str], list[TokenLogprob | None]]


@dataclass
class ReplyPlan:
    """What answers a request: per prompt, a whole generation or a stream of deltas."""

    fingerprint: str  #: the response's ``system_fingerprint``: the model's vocabulary, or the ensemble's spec
    generate: list[Callable[[], Awaitable[Generation]]]
    stream: list[Callable[[], AsyncGenerator[Delta, None]]]
    #: a stream's tokens from the completion tokens it sent (an ensemble counts every member call instead)
    tokens: Callable[[int], Tokens]
    trailer: Callable[[], dict[str, Any]] = dict  #: extra top-level fields at the end (``trace``, ``ensemble``)
    prefetch: bool = True  #: pull each stream's first delta before the first byte
    #: completions: prompt p's text when the client asked for ``echo`` (else ""); choice p*n+i
    echoes: list[str] = field(default_factory=list)
    #: completions: prompt p's token logprobs (``echo`` with ``logprobs``), before the completion's
    scored: list[Scored] | None = None
    call: Call | None = None  #: an ensemble's call (its members' requests and usage)


def chat(ctx: Context, target: Target, req: wire.ChatCompletionRequest) -> ReplyPlan:
    if isinstance(target, EnsembleTarget):
        if req.continue_final_message:
            raise InvalidRequest("'continue_final_message' is served on one model, not on an ensemble.",
                                 param="continue_final_message")
        prompt = Prompt(messages=req.message_dicts())
        return ensemble_plan(ctx, target.ensemble, req, prompt)
    return model_plan(target.engine, [req.to_generation_request(target.engine, ctx.scope)])


async def completion(ctx: Context, target: Target, req: wire.CompletionRequest) -> ReplyPlan:
    """A completion's plan; with ``echo`` and ``logprobs`` the prompt is scored here (before the first byte);
    ``max_tokens: 0`` generates nothing (the echo is the answer)."""
    if isinstance(target, EnsembleTarget):
        return await ensemble_completion(ctx, target.ensemble, req)
    engine = target.engine
    gen_reqs = req.to_generation_requests(engine, ctx.scope)
    work = model_plan(engine, gen_reqs)
    if req.max_tokens == 0:
        work.generate = [functools.partial(nothing, g, req.n) for g in gen_reqs]
        work.stream = [functools.partial(nothing_streamed, req.n) for _ in gen_reqs]
    work.echoes = [engine.tokenizer.decode(g.prompt_ids) if req.echo else "" for g in gen_reqs]
    if req.echo and req.logprobs is not None:  # log-likelihood scoring: every prompt token's logprob
        k = req.logprobs
        lps = await until_disconnect(ctx, asyncio.gather(*(engine.prompt_logprobs(g.prompt_ids, k, ctx.scope)
                                                           for g in gen_reqs)))
        work.scored = [([engine.tokenizer.decode([t]) for t in g.prompt_ids], lp) for g, lp in zip(gen_reqs, lps)]
    return work


def model_plan(engine: Engine, gen_reqs: list[GenerationRequest]) -> ReplyPlan:
    """One engine answers each prompt (``generate`` or ``stream``)."""
    prompt_tokens = sum(len(g.prompt_ids) for g in gen_reqs)
    return ReplyPlan(
        fingerprint(engine),
        [functools.partial(engine.generate, g) for g in gen_reqs],
        [functools.partial(engine.stream, g) for g in gen_reqs],
        tokens=lambda completion: (prompt_tokens, completion, sum(g.cached_tokens for g in gen_reqs)),
        trailer=trace_of(gen_reqs),
    )


async def ensemble_completion(ctx: Context, ensemble: Ensemble, req: wire.CompletionRequest) -> ReplyPlan:
    prompts = req.prompts()
    if len(prompts) != 1 or not isinstance(prompts[0], str):
        raise InvalidRequest("With an ensemble, 'prompt' must be one string (members may tokenize differently).",
                             param="prompt")
    work = ensemble_plan(ctx, ensemble, req, Prompt(text=prompts[0]))
    work.echoes = [prompts[0] if req.echo else ""]
    if req.echo and (req.logprobs is not None or req.max_tokens == 0):  # score the prompt under the ensemble
        call = work.call
        assert call is not None
        scored = await until_disconnect(ctx, ensemble.strategy.prompt_logprobs(call, req.logprobs or 0))
        if req.logprobs is not None:
            work.scored = [scored]
        if req.max_tokens == 0:
            first = call.request(ensemble.strategy.members[0])
            work.generate = [functools.partial(nothing, first, req.n, call.usage.prompt_tokens)]
            work.stream = [functools.partial(nothing_streamed, req.n)]
    return work


async def choices(ctx: Context, target: Target, question: ChoiceQuestion, combine: str | None,
                  trace: bool) -> tuple[ChoiceAnswer, int]:
    """``/v1/choices``: the choices scored by a model, or combined over an ensemble's members; and the prompt
    tokens read."""
    if isinstance(target, EnsembleTarget):
        ensemble = target.ensemble
        call = ensemble.scoring_call(Prompt(messages=question.messages, text=question.text), ctx.scope)
        charge_members(ctx, call)
        answer = await until_disconnect(ctx, ensemble.score_choices(call, question, combine))
        return answer, call.usage.prompt_tokens
    if combine is not None:
        raise InvalidRequest("'combine' applies to ensembles only.", param="combine")
    if trace:
        raise InvalidRequest("'trace' on /v1/choices applies to ensembles only.", param="trace")
    return await until_disconnect(ctx, question.answer(target.engine, scope=ctx.scope))


def counting_engine(target: Target) -> Engine:
    """The engine whose template and tokenizer count a prompt: the model's, or an ensemble's first member's."""
    return target.first_engine if isinstance(target, EnsembleTarget) else target.engine


# ---- ensembles ----

def ensemble_plan(ctx: Context, ensemble: Ensemble, req: wire.ChatCompletionRequest | wire.CompletionRequest,
                  prompt: Prompt) -> ReplyPlan:
    """The ensemble's call as the reply's work. The tokens sum every member call; token-level strategies produce
    their first token before the first byte is sent (so their errors are HTTP errors), text-level ones start the
    SSE stream at once (pings keep it open while members work) and report a failure as the final error event."""
    call = ensemble.call(prompt, req.sampling_params, n=req.n, logprobs=req.wants_logprobs, scope=ctx.scope)
    charge_members(ctx, call)
    return ReplyPlan(ensemble_fingerprint(ensemble), [lambda: ensemble.run(call)], [lambda: ensemble.stream(call)],
                     tokens=lambda _completion: (call.usage.prompt_tokens, call.usage.completion_tokens,
                                                 call.usage.cached_tokens),
                     trailer=lambda: {"ensemble": call.final_trace()} if ensemble.spec.trace else {},
                     prefetch=ensemble.strategy.token_level, call=call)


def charge_members(ctx: Context, call: Call) -> None:
    """The key is charged per member model (what each member call used), not for the ensemble's name."""
    def used() -> dict[str, tuple[int, int]]:
        by_label = {**{m.label: m.spec.model for m in call.members}, **call.model_of}  # the judge is its model
        out: dict[str, tuple[int, int]] = {}
        for label, u in call.by_member.items():
            model = by_label.get(label, label)
            p, c = out.get(model, (0, 0))
            out[model] = (p + u.prompt_tokens, c + u.completion_tokens)
        return out

    served = ctx.resolved()
    served.member_usage = used
    served.decision = lambda: call.decision  # an online router's, for feedback (api/extensions/feedback.py)


def fingerprint(engine: Engine) -> str:
    return "fp_" + engine.tokenizer.fingerprint[:10]


def ensemble_fingerprint(ensemble: Ensemble) -> str:
    spec = json.dumps(ensemble.spec.model_dump(exclude={"trace"}), sort_keys=True, default=str)
    return "fp_ens_" + hashlib.sha256(spec.encode()).hexdigest()[:8]


def trace_of(gen_reqs: list[GenerationRequest]) -> Callable[[], dict[str, Any]]:
    """The ``trace`` trailer (``"trace": true``): one prompt's is an object, several prompts' a list."""
    if gen_reqs[0].trace is None:
        return dict
    return lambda: {"trace": gen_reqs[0].trace if len(gen_reqs) == 1 else [g.trace for g in gen_reqs]}


async def nothing(gen_req: GenerationRequest, n: int, prompt_tokens: int | None = None) -> Generation:
    """``max_tokens: 0``: n empty choices (the echo is the answer); an ensemble counts every member's prompt."""
    lps: list[TokenLogprob] | None = [] if gen_req.params.logprobs else None
    used = len(gen_req.prompt_ids) if prompt_tokens is None else prompt_tokens
    return Generation([Choice(i, "", [], "length", lps) for i in range(n)], used, 0)


async def nothing_streamed(n: int) -> AsyncGenerator[Delta, None]:
    for i in range(n):
        yield Delta(i, "", [], [], "length")
