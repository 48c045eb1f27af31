"""What a router is, and the registry of routers (``router:`` in a ``route`` ensemble).

A router is built once per ensemble from the strategy's parameters and members (``check`` there: a bad parameter
is a 400 naming it), may ``warm`` up (embed its examples; named ensembles do it at start-up), and ``choose``\\s the
member that answers a call, with what the trace shows. A parameter that belongs to another router is refused
(`Router.fields` lists a router's own). Adding a router: its module here and one line in `ROUTERS`.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from chorus.ensembles.similarity import Embedder
from chorus.errors import InvalidRequest

if TYPE_CHECKING:
    from chorus.ensembles.call import Call, Member

ROUTERS: dict[str, str] = {
    "random": "chorus.ensembles.routers.random_choice:RandomRouter",
    "semantic": "chorus.ensembles.routers.semantic:SemanticRouter",
    "cost": "chorus.ensembles.routers.cost:CostRouter",
    "learned": "chorus.ensembles.routers.learned:LearnedRouting",
    "online": "chorus.ensembles.routers.online:OnlineRouter",
}


class RouteParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    router: str = Field(description="a router of the registry: random, semantic, cost, learned, online")
    weights: list[float] | None = Field(default=None, description="random: one per member (default equal)")
    examples: dict[str, list[str]] | None = Field(default=None, description="semantic: member label -> prompts")
    examples_file: str | None = Field(default=None, description='semantic: JSONL of {"member": ..., "prompt": ...}')
    k: int = Field(default=5, ge=1, le=100, description="semantic / cost: nearest examples that count")
    threshold: float | None = Field(default=None, ge=-1.0, le=1.0,
                                    description="semantic: below this best similarity the default member answers")
    default: str | None = Field(default=None, description="semantic: member label for unmatched prompts (first); "
                                "online: the arm of the safe start (first)")
    hard_examples: list[str] | None = Field(default=None, description="cost: prompts that need a strong model")
    easy_examples: list[str] | None = Field(default=None, description="cost: prompts a weak model handles")
    thresholds: list[float] | None = Field(default=None, description="cost: ascending, one fewer than members")
    artifact: str | None = Field(default=None, description="learned: a router trained by chorus bench selector")
    margin: float | None = Field(default=None, ge=0.0, le=1.0,
                                 description="learned: predicted-accuracy margin for a cheaper member (artifact's)")
    # online (routers/online.py, routers/bandit.py): arms are the members and these named ensembles
    ensembles: list[str] | None = Field(default=None, description="online: named ensembles that are arms too")
    metric: str | None = Field(default=None, description="online: the feedback metric it learns from (required)")
    cost_weight: float | None = Field(default=None, ge=0.0, description="online: reward minus this x cost (0)")
    cost: Literal["tokens", "price"] | None = Field(
        default=None, description="online: cost in thousands of tokens, or by the config's prices (tokens)")
    alpha: float | None = Field(default=None, ge=0.0, description="online: confidence bonus weight (0.3)")
    explore: float | None = Field(default=None, ge=0.0, le=1.0, description="online: first exploration rate (0.1)")
    explore_half_life: float | None = Field(default=None, gt=0.0,
                                            description="online: feedbacks until exploration halves (200)")
    explore_floor: float | None = Field(default=None, ge=0.0, le=1.0,
                                        description="online: exploration never below this (0.02)")
    warmup: int | None = Field(default=None, ge=0, description="online: feedbacks before it chooses (30)")
    discount: float | None = Field(default=None, gt=0.0, le=1.0,
                                   description="online: weight kept by old evidence per update (1: all)")
    dims: int | None = Field(default=None, ge=0, le=384,
                             description="online: embedding projected to this many numbers (0: all 384)")

    @field_validator("thresholds")
    @classmethod
    def _ascending(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and any(b < a for a, b in itertools.pairwise(v)):
            raise ValueError("thresholds must be in ascending order (members go cheap to expensive)")
        return v


class Router:
    #: the parameters of RouteParams this router reads (besides ``router``); any other one set is a 400
    fields: ClassVar[frozenset[str]] = frozenset()
    #: answers ``/v1/choices`` with the one member it picks (else every member's scores are averaged)
    scores_choices: ClassVar[bool] = False
    #: learns from feedback across requests (online): it must be named in the config, its state shared
    learns_online: ClassVar[bool] = False

    def __init__(self, params: RouteParams, members: list[Member]) -> None:
        self.params = params
        self.members = members

    async def warm(self) -> None:
        """Prepare what choosing needs (embeddings of examples); called before the first choice."""

    async def choose(self, call: Call, seed: int | None) -> tuple[Member, dict[str, Any]]:
        raise NotImplementedError

    async def choose_text(self, text: str) -> tuple[Member, dict[str, Any]]:
        """The member for a text prompt alone (a router that `scores_choices`)."""
        raise NotImplementedError

    @classmethod
    def check_links(cls, params: RouteParams, name: str, ensembles: set[str], metrics: set[str]) -> None:
        """The config's check of what the router refers to (named ensembles, feedback metrics)."""

    def bind(self, ensemble: str, named: dict[str, Any], outcomes: Any) -> None:
        """A named ensemble's router at start-up: the served ensembles (arms) and the shared outcome log."""

    def feedback_metric(self) -> str | None:
        """The feedback metric it learns from (online routers)."""
        return None

    async def learn(self, decision: dict[str, Any], quality: float, tokens: int, price: float) -> bool:
        """Feedback on a request it routed (``decision``: what it recorded); whether it learned from it."""
        return False



class ExampleRouter(Router):
    """A router that reads example prompts (semantic, cost): ``examples`` by group, embedded once."""

    examples: dict[str, list[str]]
    _embedded: dict[str, np.ndarray] | None = None

    async def warm(self) -> None:
        if self._embedded is None:
            labels = list(self.examples)
            texts = [t for lb in labels for t in self.examples[lb]]
            emb = await asyncio.to_thread(Embedder.embed, texts)
            out, i = {}, 0
            for lb in labels:
                out[lb] = emb[i: i + len(self.examples[lb])]  # (E_lb, 384)
                i += len(self.examples[lb])
            self._embedded = out

    async def embedded(self) -> dict[str, np.ndarray]:
        await self.warm()
        assert self._embedded is not None
        return self._embedded


def router_class(name: str) -> type[Router]:
    target = ROUTERS.get(name)
    if target is None:
        raise InvalidRequest(f"unknown router {name!r}; known: {', '.join(sorted(ROUTERS))}.",
                             param="ensemble.router")
    module, _, cls = target.partition(":")
    found: type[Router] = getattr(importlib.import_module(module), cls)
    return found


def build_router(params: RouteParams, members: list[Member]) -> Router:
    """The router ``params.router`` names, its parameters checked (another router's parameter is a 400)."""
    klass = router_class(params.router)
    foreign = sorted(f for f in params.model_fields_set - {"router"} - klass.fields
                     if getattr(params, f) is not None)
    if foreign:
        owners = {f: [n for n in ROUTERS if f in router_class(n).fields] for f in foreign}
        raise InvalidRequest("; ".join(f"'{f}' applies to router: {' / '.join(owners[f])} only" for f in foreign)
                             + f" (this ensemble's router is {params.router}).", param=f"ensemble.{foreign[0]}")
    return klass(params, members)
