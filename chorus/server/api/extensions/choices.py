"""``POST /v1/choices``: multiple-choice scoring, a chorus extension (README, HTTP API).

    {"model", "prompt" | "messages", "choices": [str, ...], "normalisations"?, "combine"?, "ensemble"?,
     "trace"?}
    -> {"object": "choice.scores", "model", "choices": [{"index", "text", "logprob", "tokens",
        "probabilities": {"sum", "mean", "char", "unconditional"}}], "chosen": {normalisation: index}, "usage"}

A model scores each choice after the prompt (engines/core/scoring.py: a plain model reads the prompt once,
in one tree-masked forward with every choice); an ensemble (named, or the body's ``ensemble``) combines its
members' distributions over the choices, or per token for one vocabulary (ensembles/choice_scores.py).
Unknown fields are refused (400), unlike on the OpenAI routes: this body is chorus's own.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, model_validator

from chorus.ensembles.choice_scores import COMBINES, ChoiceAnswer, ChoiceQuestion
from chorus.errors import InvalidRequest
from chorus.server import plan
from chorus.server.gateway.accounting import settle
from chorus.server.gateway.context import Ctx
from chorus.server.resolve import EnsembleTarget, resolve
from chorus.server.wire import render
from chorus.server.wire import request as wire

router = APIRouter()


class ChoicesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    prompt: str | None = Field(default=None, description="text the choices continue")
    messages: list[wire.ChatMessage] | None = Field(
        default=None, description="or: a chat, rendered with the template"
    )
    choices: list[str] = Field(description="the candidate continuations")
    normalisations: list[str] | None = Field(
        default=None, description="which probabilities to return (default all: sum, mean, char, unconditional)")
    combine: str | None = Field(default=None, description="ensembles: 'probabilities' or 'tokens' (one vocabulary)")
    ensemble: dict[str, Any] | None = Field(default=None, description="an ensemble, as on the chat route")
    trace: bool = Field(default=False, description="ensembles: each member's scores in the response")
    logprobs: bool = Field(default=False, description="each choice's token logprobs (and unconditional logprob)")

    @model_validator(mode="after")
    def _check(self) -> ChoicesRequest:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("Give exactly one of 'prompt' or 'messages'.", param="prompt")
        if not self.choices:
            raise InvalidRequest("'choices' must hold at least one string.", param="choices")
        if self.combine is not None and self.combine not in COMBINES:
            raise InvalidRequest(f"'combine' must be one of {', '.join(COMBINES)}.", param="combine")
        return self

    def message_dicts(self) -> list[dict[str, Any]] | None:
        return None if self.messages is None else [m.model_dump(exclude_none=True) for m in self.messages]

    def question(self) -> ChoiceQuestion:
        kw = {} if self.normalisations is None else {"normalisations": self.normalisations}
        return ChoiceQuestion(list(self.choices), text=self.prompt, messages=self.message_dicts(), **kw)


@router.post("/v1/choices")
async def choices(req: ChoicesRequest, ctx: Ctx) -> dict[str, Any]:
    limits = ctx.config.server.limits
    if len(req.choices) > limits.max_choices:
        raise InvalidRequest(f"At most {limits.max_choices} choices per request on this server (got "
                             f"{len(req.choices)}).", param="choices")
    question = req.question()
    target = resolve(ctx, req, use="score")
    # the body's ``trace``, or the ensemble's own (``ensemble.trace``, or a named ensemble's), as on the chat route
    trace = req.trace or (isinstance(target, EnsembleTarget) and target.ensemble.spec.trace)
    answer, prompt_tokens = await plan.choices(ctx, target, question, req.combine, trace)
    usage = render.usage(prompt_tokens, 0)
    settle(ctx, req.model, usage)
    return reply(req, answer, usage, trace)


def reply(req: ChoicesRequest, answer: ChoiceAnswer, usage: dict[str, int], trace: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": render.new_id("choice"), "object": "choice.scores", "created": int(time.time()), "model": req.model,
        "choices": [{"index": i, "text": text,
                     "logprob": None if answer.logprobs is None else answer.logprobs[i],
                     "tokens": None if answer.tokens is None else answer.tokens[i],
                     "probabilities": {n: p[i] for n, p in answer.probabilities.items()}}
                    for i, text in enumerate(req.choices)],
        "chosen": answer.chosen, "usage": usage,
    }
    if req.logprobs:
        if answer.per_token is None:
            raise InvalidRequest("'logprobs' needs one tokenization under the scores: a single language model, "
                                 "or combine 'tokens' (a scorer model has no token logprobs).", param="logprobs")
        for i, c in enumerate(out["choices"]):
            c["token_logprobs"] = answer.per_token[i]
            c["unconditional_logprob"] = None if answer.unconditional is None else answer.unconditional[i]
    if trace:
        out["ensemble"] = answer.trace
    return out
