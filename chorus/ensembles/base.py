"""Strategies, their registry, and what a strategy gets for one request.

A strategy combines member engines for one request. It only talks to the Engine API, so it runs
the same on in-process models and on remote workers::

    Ensemble.build(spec, engines)   validation: 400s (unknown strategy / member, bad params,
                                    missing capability) before any work is done
    Ensemble.call(prompt, ...)      a `Call` (call.py): the request's prompt and sampling, usage and trace
    strategy.stream(call)           deltas of the final answer; token-level strategies yield tokens
                                    as they are chosen, text-level ones the answer once chosen

Registries are plain dicts of lazily imported ``"module:Class"`` strings: importing `ensembles`
imports no strategy code, registering a name twice with another target is an error, and an unknown
name's error lists the valid ones.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from chorus.engines.core.base import (
    TEXT,
    ChoiceScorer,
    Delta,
    Engine,
    Generation,
    SamplingParams,
    TokenLogprob,
)
from chorus.engines.core.generation import collect
from chorus.engines.core.request_scope import UNSCOPED, RequestScope
from chorus.ensembles.call import Call, Member, Prompt, gather, resolve_members
from chorus.ensembles.choice_scores import ChoiceAnswer, ChoiceQuestion, average
from chorus.ensembles.metrics import ENSEMBLE_REQUESTS
from chorus.ensembles.spec import EnsembleSpec, NamedEnsemble, member_weights
from chorus.errors import CapabilityMismatch, InvalidRequest
from chorus.lazy import load

T = TypeVar("T")

STRATEGIES: dict[str, str] = {
    "logit_average": "chorus.ensembles.logit_average.strategy:LogitAverageStrategy",
    "exchange_of_thought": "chorus.ensembles.strategies.exchange_of_thought:ExchangeOfThought",
    "crowd_vote": "chorus.ensembles.strategies.crowd_vote:CrowdVote",
    "mixture_of_agents": "chorus.ensembles.strategies.mixture_of_agents:MixtureOfAgents",
    "route": "chorus.ensembles.strategies.route:Route",
    "cascade": "chorus.ensembles.strategies.cascade:Cascade",
    "choice_average": "chorus.ensembles.strategies.choice_average:ChoiceAverage",
    "select": "chorus.ensembles.strategies.select:Select",
    "answer_vote": "chorus.ensembles.strategies.answer_vote:AnswerVote",
    "consistency_select": "chorus.ensembles.strategies.consistency_select:ConsistencySelect",
}


def register(name: str, target: str) -> None:
    """Register a strategy class by ``"module:Class"`` (e.g. from the config's ``strategies``)."""
    if ":" not in target:
        raise ValueError(f"strategy target must be 'module:Class', got {target!r}")
    if STRATEGIES.get(name, target) != target:
        raise ValueError(f"strategy {name!r} is already registered ({STRATEGIES[name]})")
    STRATEGIES[name] = target


def strategy_class(name: str) -> type[Strategy]:
    try:
        target = STRATEGIES[name]
    except KeyError:
        raise InvalidRequest(f"Unknown ensemble strategy {name!r}. Valid strategies: {', '.join(sorted(STRATEGIES))}.",
                             param="ensemble.strategy") from None
    found = load(target)
    if not (isinstance(found, type) and issubclass(found, Strategy)):
        raise TypeError(f"{target} is not an ensembles.base.Strategy subclass")
    return found


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class Budget:
    """What a request of a strategy may cost beyond one call per member: the server's limits check it."""

    rounds: int = 0  #: exchange rounds after the first answers (exchange_of_thought)
    candidates: int = 0  #: answers to score (crowd_vote: given, or sampled from the members)


class Strategy:
    """Base class of every strategy; subclasses set the class attributes and implement `stream`.

    ``requires``: capabilities every member engine needs. ``Params``: a pydantic model of the strategy's
    own parameters (unknown fields are refused). ``token_level``: streams tokens as they are chosen and
    supports ``n`` and ``logprobs``; text-level strategies produce one answer.
    """

    requires: ClassVar[frozenset[str]] = frozenset({TEXT})
    Params: ClassVar[type[BaseModel]] = NoParams
    token_level: ClassVar[bool] = False
    supports_logprobs: ClassVar[bool] = False
    default_on_member_error: ClassVar[str] = "skip"
    min_members: ClassVar[int] = 2
    #: serves /v1/choices only (its members may be scorer models, which generate nothing)
    scores_only: ClassVar[bool] = False
    #: a text-level strategy that answers ``n`` > 1 with several of its candidates (answer_vote)
    answers_n: ClassVar[bool] = False

    def __init__(self, name: str, members: list[Member], params: Any, engines: dict[str, Engine],
                 ensemble: str | None = None) -> None:
        self.name = name
        self.ensemble = ensemble or f"inline:{name}"  # the named ensemble, for metrics and logs
        self.members = members
        self.params = params
        self.engines = engines
        self.check()

    @classmethod
    def check_config(cls, params: Any, members: list[str]) -> None:
        """What a named ensemble's config entry can be checked for before any model loads (``members``: their
        model names); raise `InvalidRequest`, which the config reports as its error."""

    @classmethod
    def check_links(cls, params: Any, name: str, ensembles: set[str], metrics: set[str]) -> None:
        """What a named ensemble's entry refers to elsewhere in the config: other named ensembles, feedback
        metrics (``server.feedback.metrics``); raise `InvalidRequest` naming what is missing."""

    @classmethod
    def member_minimum(cls, params: Any) -> int:
        return cls.min_members

    def check(self) -> None:
        """Strategy-specific validation (raise `InvalidRequest`); called once when the ensemble is built."""

    def budget(self) -> Budget:
        """The request's cost beyond one call per member (none by default)."""
        return Budget()

    async def prompt_logprobs(self, call: Call, k: int) -> tuple[list[str], list[TokenLogprob | None]]:
        """The prompt's tokens and each one's logprob under the ensemble given the ones before it (None for
        the first): ``echo`` + ``logprobs`` scoring. Only a distribution over one vocabulary can score."""
        raise InvalidRequest(f"The '{self.name}' strategy cannot score a prompt ('echo' with 'logprobs' or "
                             "'max_tokens': 0); logit_average over one vocabulary can.", param="echo")

    async def score_choices(self, call: Call, question: ChoiceQuestion, combine: str | None) -> ChoiceAnswer:
        """Multiple-choice scoring (``/v1/choices``): every member scores the choices with its own tokenizer
        and the members' distributions over the choices are averaged (``probabilities``), with the
        strategy's ``weights`` where it has them. Token-level combination is logit_average's (``tokens``)."""
        if combine not in (None, "probabilities"):
            raise InvalidRequest(f"combine {combine!r} is not available for the '{self.name}' strategy: members "
                                 "combine by averaging their probabilities over the choices ('probabilities'); "
                                 "'tokens' needs logit_average over one vocabulary.", param="combine")
        weights = member_weights(getattr(self.params, "weights", None), len(self.members))

        async def one(m: Member) -> ChoiceAnswer:
            msgs = m.persona(question.messages) if question.messages is not None else None
            answer, tokens = await question.answer(m.engine, msgs, call.scope)
            call.record(m, tokens, 0)
            return answer

        answers = await gather(*(one(m) for m in self.members))
        probabilities = average(answers, weights)
        trace = {"combine": "probabilities", "weights": weights,
                 "scores": [{"member": m.label, "logprobs": a.logprobs, "tokens": a.tokens,
                              "probabilities": a.probabilities} for m, a in zip(self.members, answers)]}
        return ChoiceAnswer(probabilities, trace=trace)

    async def warm(self) -> None:
        """Slow one-off preparation (e.g. embedding examples); the server runs it at start-up for named ensembles."""

    def bind(self, named: dict[str, Ensemble], outcomes: Any) -> None:
        """A named ensemble at start-up: the other named ensembles (arms of an online router) and the shared
        outcome log (routers/outcomes.py)."""

    def feedback_metric(self) -> str | None:
        """The feedback metric this ensemble learns from across requests (None: it learns nothing); one that learns
        is served named only and bound at start-up."""
        return None

    async def learn(self, decision: dict[str, Any], quality: float, tokens: int, price: float) -> bool:
        """Feedback on one of its requests (``decision``: what it recorded then); whether it learned from it."""
        return False

    def precheck(self, call: Call) -> None:
        """Validation that needs the request (context lengths): runs before any member is called."""
        for m in self.members:
            call.request(m)

    def stream(self, call: Call) -> AsyncGenerator[Delta, None]:  # pragma: no cover - abstract
        raise NotImplementedError

    def models(self) -> list[str]:
        """Every served model this strategy calls (a key must be allowed all of them for an inline ensemble)."""
        return [m.spec.model for m in self.members]

    def describe(self) -> dict[str, Any]:
        return {"strategy": self.name, "members": [{"label": m.label, "model": m.spec.model, **m.engine.placement()}
                                                   for m in self.members]}


@dataclass
class Ensemble:
    """A validated ensemble, ready to run any number of requests."""

    spec: EnsembleSpec
    strategy: Strategy

    @property
    def on_member_error(self) -> str:
        return self.spec.on_member_error or self.strategy.default_on_member_error

    @property
    def description(self) -> str | None:
        """A named ensemble's description from the config (None for one given in a request body)."""
        return self.spec.description if isinstance(self.spec, NamedEnsemble) else None

    @property
    def model_for_defaults(self) -> Engine | None:
        return self.strategy.members[0].engine if self.strategy.members else None

    @classmethod
    def build(cls, spec: EnsembleSpec, engines: dict[str, Engine], name: str | None = None) -> Ensemble:
        klass = strategy_class(spec.strategy)
        try:
            params = klass.Params.model_validate(spec.params)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise InvalidRequest(f"Invalid parameter for ensemble strategy {spec.strategy!r}: {where}: {err['msg']}. "
                                 f"Valid parameters: {', '.join(klass.Params.model_fields) or 'none'}.",
                                 param=f"ensemble.{where}" if where else "ensemble") from None
        members = resolve_members(spec.members, engines)
        if len(members) < klass.member_minimum(params):
            raise InvalidRequest(f"Ensemble strategy {spec.strategy!r} needs at least {klass.member_minimum(params)} "
                                 f"members, "
                                 f"got {len(members)}.", param="ensemble.members")
        scorers = [m.label for m in members if isinstance(m.engine, ChoiceScorer)]
        if scorers and not klass.scores_only:
            raise CapabilityMismatch(f"{', '.join(scorers)}: multiple-choice scorer model(s), which generate nothing; "
                                     "they can only join a 'choice_average' ensemble (POST /v1/choices).",
                                     param="ensemble.members")
        lacking = sorted({m.label for m in members if not klass.requires <= m.engine.capabilities})
        if lacking:
            raise CapabilityMismatch(
                f"Ensemble strategy {spec.strategy!r} needs members with {', '.join(sorted(klass.requires))}; "
                f"these members lack it: {', '.join(lacking)}.", param="ensemble.members")
        return cls(spec, klass(spec.strategy, members, params, engines, name or getattr(spec, "name", None)))

    def call(self, prompt: Prompt, sampling: Callable[[dict[str, float]], SamplingParams], *, n: int = 1,
             logprobs: bool = False, scope: RequestScope = UNSCOPED) -> Call:
        """One request's call (``scope``: what the request carries to the members' engines)."""
        s = self.strategy
        if s.scores_only:
            raise InvalidRequest(f"The {self.spec.strategy!r} ensemble scores choices only (POST /v1/choices); it "
                                 "generates no text.", param="model")
        if n > 1 and not (s.token_level or s.answers_n):
            raise InvalidRequest(f"'n' must be 1 with the text-level strategy {self.spec.strategy!r}.", param="n")
        if logprobs and not (s.token_level or s.supports_logprobs):
            raise InvalidRequest(f"'logprobs' is not available with the strategy {self.spec.strategy!r}.",
                                 param="logprobs")
        if sampling({}).logit_bias:
            raise InvalidRequest("'logit_bias' names token ids of one vocabulary; an ensemble's members each have "
                                 "their own: send it to a single model.", param="logit_bias")
        spec = self.spec

        def bounded(defaults: dict[str, float]) -> SamplingParams:
            """The client's sampling; a member call's length is ``call_max_tokens`` when the client gave none."""
            params = sampling(defaults)
            return params if params.max_tokens is not None else replace(params, max_tokens=spec.call_max_tokens)

        call = Call(list(s.members), prompt, bounded, self.on_member_error, logprobs, s.ensemble, trace=s.describe(),
                    detail=spec.trace, n=n, deadline_s=spec.deadline_s, max_total_tokens=spec.max_total_tokens,
                    scope=scope)
        s.precheck(call)
        return call

    def scoring_call(self, prompt: Prompt, scope: RequestScope = UNSCOPED) -> Call:
        """A call that scores choices after ``prompt``: nothing is sampled or generated."""
        s = self.strategy
        return Call(s.members, prompt, lambda _defaults: SamplingParams(), self.on_member_error,
                    ensemble=s.ensemble, trace=s.describe(), scope=scope)

    async def score_choices(self, call: Call, question: ChoiceQuestion, combine: str | None) -> ChoiceAnswer:
        ENSEMBLE_REQUESTS.labels(self.strategy.ensemble, self.spec.strategy).inc()
        answer = await self.strategy.score_choices(call, question, combine)
        answer.trace = {**call.final_trace(), **answer.trace}
        return answer

    def stream(self, call: Call) -> AsyncGenerator[Delta, None]:
        ENSEMBLE_REQUESTS.labels(self.strategy.ensemble, self.spec.strategy).inc()
        return self.strategy.stream(call)

    async def run(self, call: Call) -> Generation:
        choices = await collect(self.stream(call), call.logprobs)
        return Generation(choices, call.usage.prompt_tokens, call.usage.completion_tokens, call.usage.cached_tokens)
