"""What a router is, and the registry of routers (``router:`` in a ``route`` ensemble).

A router is built once per ensemble from the strategy's parameters and members (``check`` there: a bad parameter
is a 400 naming it), may ``warm`` up (embed its examples; named ensembles do it at start-up), and ``choose``\\s the
member that answers a call, with what the trace shows. A parameter that belongs to another router is refused
(each router's `Params` declares its own). Adding a router: its module here and one line in `ROUTERS`.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from chorus.ensembles.similarity import Embedder
from chorus.errors import InvalidRequest
from chorus.lazy import load

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
    """The ``route`` strategy's own parameter, ``router``; every other one belongs to that router (its `Params`,
    checked by `router_params`: another router's parameter is a 400 naming the routers it belongs to)."""

    model_config = ConfigDict(extra="allow")

    router: str = Field(description="a router of the registry: random, semantic, cost, learned, online")

    def router_params(self) -> Any:
        """The router's own parameters, validated by its `Params` model."""
        return router_params(self.router, dict(self.model_extra or {}))


class Router:
    #: the router's own parameters (besides ``router``); another router's parameter, set, is a 400
    Params: ClassVar[type[BaseModel]]
    #: answers ``/v1/choices`` with the one member it picks (else every member's scores are averaged)
    scores_choices: ClassVar[bool] = False
    #: learns from feedback across requests (online): it must be named in the config, its state shared
    learns_online: ClassVar[bool] = False

    def __init__(self, params: Any, members: list[Member]) -> None:
        self.params = params  #: an instance of the router's `Params`
        self.members = members

    async def warm(self) -> None:
        """Prepare what choosing needs (embeddings of examples); called before the first choice."""

    async def choose(self, call: Call, seed: int | None) -> tuple[Member, dict[str, Any]]:
        raise NotImplementedError

    async def choose_text(self, text: str) -> tuple[Member, dict[str, Any]]:
        """The member for a text prompt alone (a router that `scores_choices`)."""
        raise NotImplementedError

    @classmethod
    def check_links(cls, params: Any, name: str, ensembles: set[str], metrics: set[str]) -> None:
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
    found: type[Router] = load(target)
    return found


def router_params(name: str, given: dict[str, Any]) -> Any:
    """``given`` validated by the router ``name``'s `Params`; a parameter it does not own is a 400 naming the
    routers that do (or saying none does)."""
    klass = router_class(name)
    foreign = sorted(f for f, v in given.items() if f not in klass.Params.model_fields and v is not None)
    if foreign:
        owners = {f: [n for n in ROUTERS if f in router_class(n).Params.model_fields] for f in foreign}
        raise InvalidRequest("; ".join(f"'{f}' applies to router: {' / '.join(owners[f])} only" if owners[f] else
                                       f"'{f}' is no parameter of any router" for f in foreign)
                             + f" (this ensemble's router is {name}). The {name} router's parameters: "
                             f"{', '.join(klass.Params.model_fields) or 'none'}.", param=f"ensemble.{foreign[0]}")
    try:
        return klass.Params.model_validate({f: v for f, v in given.items() if v is not None})
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise InvalidRequest(f"Invalid parameter for router {name!r}: {where}: {err['msg']}.",
                             param=f"ensemble.{where}" if where else "ensemble") from None


def build_router(params: RouteParams, members: list[Member]) -> Router:
    """The router ``params.router`` names, with its own parameters checked."""
    return router_class(params.router)(params.router_params(), members)
