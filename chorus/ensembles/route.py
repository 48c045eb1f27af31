"""``route``: one member answers each request; a router picks which (and the trace says why).

- ``random``: weighted choice (A/B splits, canaries); the request's ``seed`` makes it reproducible.
- ``semantic``: the prompt's embedding (all-MiniLM-L6-v2) against labelled example prompts per member:
  the k nearest examples (cosine) vote, weighted by similarity; if the nearest is below ``threshold``,
  the ``default`` member answers. Example embeddings are computed once per ensemble and cached.
- ``cost``: members ordered cheap to expensive; the request's score is its mean similarity to its k
  nearest ``hard_examples`` (minus the same for ``easy_examples`` when given), and the ``thresholds``
  (one fewer than members, ascending) split the score range: score >= thresholds[i] goes to member
  i + 1 or beyond (RouteLLM's strong / weak pair, generalised). `chorus route calibrate` sets the
  thresholds for a target share of calls from a sample of prompts.

The chosen member's answer streams token by token (``n``, ``logprobs`` as for that model).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import json
import random
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from chorus.engines.base import Delta
from chorus.ensembles.base import Strategy
from chorus.ensembles.call import Call, Member
from chorus.ensembles.choice_scores import ChoiceAnswer, ChoiceQuestion
from chorus.ensembles.metrics import ROUTE_DECISIONS
from chorus.ensembles.router_model import ARTIFACT, LearnedRouter
from chorus.ensembles.selection import load_trained
from chorus.ensembles.similarity import Embedder
from chorus.errors import InvalidRequest

ROUTERS = ("random", "semantic", "cost", "learned")


class RouteParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    router: Literal["random", "semantic", "cost", "learned"]
    weights: list[float] | None = Field(default=None, description="random: one per member (default equal)")
    examples: dict[str, list[str]] | None = Field(default=None, description="semantic: member label -> prompts")
    examples_file: str | None = Field(default=None, description='semantic: JSONL of {"member": ..., "prompt": ...}')
    k: int = Field(default=5, ge=1, le=100, description="semantic / cost: nearest examples that count")
    threshold: float | None = Field(default=None, ge=-1.0, le=1.0,
                                    description="semantic: below this best similarity the default member answers")
    default: str | None = Field(default=None, description="semantic: member label for unmatched prompts (first)")
    hard_examples: list[str] | None = Field(default=None, description="cost: prompts that need a strong model")
    easy_examples: list[str] | None = Field(default=None, description="cost: prompts a weak model handles")
    thresholds: list[float] | None = Field(default=None, description="cost: ascending, one fewer than members")
    artifact: str | None = Field(default=None, description="learned: a router trained by chorus bench selector")
    margin: float | None = Field(default=None, ge=0.0, le=1.0,
                                 description="learned: predicted-accuracy margin for a cheaper member (artifact's)")

    @field_validator("thresholds")
    @classmethod
    def _ascending(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and any(b < a for a, b in itertools.pairwise(v)):
            raise ValueError("thresholds must be in ascending order (members go cheap to expensive)")
        return v


def load_examples(path: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise InvalidRequest(f"cannot read examples_file {path}: {exc}", param="ensemble.examples_file") from None
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                item = json.loads(line)
                out.setdefault(str(item["member"]), []).append(str(item["prompt"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise InvalidRequest(f"{path}:{n}: need {{\"member\": ..., \"prompt\": ...}}",
                                     param="ensemble.examples_file") from None
    return out


def load_router(name: str | None, members: list[str]) -> LearnedRouter:
    if not name:
        raise InvalidRequest("router: learned needs 'artifact' (a router trained by `chorus bench selector`).",
                             param="ensemble.artifact")
    router: LearnedRouter = load_trained(name, ARTIFACT, LearnedRouter.load, members, "router")
    return router


def knn_similarity(query: np.ndarray, examples: np.ndarray, k: int) -> float:
    """Mean cosine of the k nearest examples. query (384,), examples (E, 384)."""
    sims = examples @ query  # (E,)
    return float(np.sort(sims)[-k:].mean())


def difficulty(query: np.ndarray, hard: np.ndarray, easy: np.ndarray | None, k: int) -> float:
    """The cost router's score: nearness to hard examples, minus nearness to easy ones when given."""
    s = knn_similarity(query, hard, k)
    return s - knn_similarity(query, easy, k) if easy is not None else s


class Route(Strategy):
    Params = RouteParams
    token_level = True  # one member answers: its tokens stream as made
    default_on_member_error = "fail"

    def check(self) -> None:
        p: RouteParams = self.params
        labels = [m.label for m in self.members]
        n = len(self.members)
        self._embedded: dict[str, np.ndarray] | None = None
        if p.router == "random":
            if p.weights is not None and (len(p.weights) != n or any(w < 0 for w in p.weights) or sum(p.weights) <= 0):
                raise InvalidRequest(
                    f"'weights' must be {n} non-negative numbers (one per member) with a positive sum.",
                    param="ensemble.weights",
                )
        if p.router != "learned" and (p.artifact is not None or p.margin is not None):
            raise InvalidRequest("'artifact' and 'margin' apply to router: learned only.", param="ensemble.router")
        if p.router == "learned":
            self.learned = load_router(p.artifact, [m.spec.model for m in self.members])
        elif p.router == "random":
            pass
        elif p.router == "semantic":
            examples = dict(p.examples or {})
            if p.examples_file:
                for member, prompts in load_examples(p.examples_file).items():
                    examples.setdefault(member, []).extend(prompts)
            unknown = sorted(set(examples) - set(labels))
            if unknown:
                raise InvalidRequest(f"examples name unknown members: {', '.join(unknown)}; members are "
                                     f"{', '.join(labels)}.", param="ensemble.examples")
            default = p.default or labels[0]
            if default not in labels:
                raise InvalidRequest(f"'default' must be one of the members: {', '.join(labels)}.",
                                     param="ensemble.default")
            missing = [lb for lb in labels if lb != default and not examples.get(lb)]
            if missing:
                raise InvalidRequest(f"the semantic router needs example prompts for every member but the default; "
                                     f"none for: {', '.join(missing)}.", param="ensemble.examples")
            self.examples = {lb: examples[lb] for lb in labels if examples.get(lb)}
            self.default = next(m for m in self.members if m.label == default)
        else:
            if not p.hard_examples:
                raise InvalidRequest("the cost router needs 'hard_examples' (prompts that need the stronger model).",
                                     param="ensemble.hard_examples")
            if p.thresholds is None or len(p.thresholds) != n - 1:
                raise InvalidRequest(f"the cost router needs 'thresholds': {n - 1} ascending number(s) for {n} members "
                                     "ordered cheap to expensive (`chorus route calibrate` computes them).",
                                     param="ensemble.thresholds")
            self.examples = {"hard": p.hard_examples, **({"easy": p.easy_examples} if p.easy_examples else {})}

    async def warm(self) -> None:
        """Embed the examples (once; named ensembles do it at start-up)."""
        if self.params.router not in ("random", "learned") and self._embedded is None:
            labels = list(self.examples)
            texts = [t for lb in labels for t in self.examples[lb]]
            emb = await asyncio.to_thread(Embedder.embed, texts)
            out, i = {}, 0
            for lb in labels:
                out[lb] = emb[i: i + len(self.examples[lb])]
                i += len(self.examples[lb])
            self._embedded = out

    async def score(self, text: str) -> float:
        """The cost router's difficulty score of a prompt."""
        await self.warm()
        assert self._embedded is not None
        q = (await asyncio.to_thread(Embedder.embed, [text]))[0]
        return difficulty(q, self._embedded["hard"], self._embedded.get("easy"), self.params.k)

    async def choose(self, call: Call, seed: int | None) -> tuple[Member, dict[str, Any]]:
        p: RouteParams = self.params
        if p.router == "random":
            w = p.weights or [1.0] * len(self.members)
            m = random.Random(seed).choices(self.members, weights=w)[0]
            return m, {
                "weights": w,
                "reason": "weighted random choice" + (f" (seed {seed})" if seed is not None else ""),
            }
        if p.router == "learned":
            return await self.choose_learned(call.prompt.question)
        if p.router == "cost":
            score = await self.score(call.prompt.question)
            i = bisect.bisect_right(p.thresholds or [], score)  # set for a cost router (checked at build)
            return self.members[i], {"score": score, "thresholds": p.thresholds,
                                     "reason": f"difficulty score {score:.4f} -> member {i} (cheap to expensive)"}
        await self.warm()
        assert self._embedded is not None
        q = (await asyncio.to_thread(Embedder.embed, [call.prompt.question]))[0]
        sims = [(float(s), lb) for lb, e in self._embedded.items() for s in (e @ q).tolist()]
        sims.sort(reverse=True)
        nearest = sims[: p.k]
        votes: dict[str, float] = {}
        for s, lb in nearest:
            votes[lb] = votes.get(lb, 0.0) + s
        best = max(votes, key=lambda lb: votes[lb])
        info = {"nearest": [{"member": lb, "similarity": round(s, 4)} for s, lb in nearest], "votes": votes}
        if p.threshold is not None and nearest[0][0] < p.threshold:
            return self.default, {**info, "reason": f"nearest example similarity {nearest[0][0]:.3f} < threshold "
                                                    f"{p.threshold}: default member"}
        return next(m for m in self.members if m.label == best), {
            **info, "reason": f"{best} has the most similar examples among the {len(nearest)} nearest"}

    async def choose_learned(self, text: str) -> tuple[Member, dict[str, Any]]:
        r = self.learned
        q = (await asyncio.to_thread(Embedder.embed, [text]))[0]
        pred, nearest, sims = r.predict(q)
        i = r.choose(pred, self.params.margin)
        margin = r.margin if self.params.margin is None else self.params.margin
        info = {"predicted_correct": {m.label: round(float(x), 4) for m, x in zip(self.members, pred)},
                "neighbours": [{"item": int(j), "similarity": round(float(s), 4)} for j, s in zip(nearest, sims)],
                "margin": margin, "fallback": r.fallback,
                "reason": (f"fallback to {r.fallback}: {r.training.get('fallback_reason')}" if r.fallback else
                           f"the cheapest member predicted within {margin} of the best")}
        return self.members[i], info

    async def score_choices(self, call: Call, question: ChoiceQuestion, combine: str | None) -> ChoiceAnswer:
        """A learned router answers a multiple-choice question with the one member it picks from the prompt;
        the other routers average every member (the base behaviour)."""
        if self.params.router != "learned":
            return await super().score_choices(call, question, combine)
        if question.text is None:
            raise InvalidRequest("A learned router reads a text 'prompt', not chat 'messages'.", param="messages")
        member, why = await self.choose_learned(question.text)
        ROUTE_DECISIONS.labels(self.ensemble, "learned", member.label).inc()
        answer, tokens = await question.answer(member.engine)
        call.record(member, tokens, 0)
        answer.trace = {"router": "learned", **why, "winner": {"member": member.label}}
        return answer

    async def stream(self, call: Call) -> AsyncGenerator[Delta, None]:
        seed = call.sampling({}).seed
        member, why = await self.choose(call, seed)
        ROUTE_DECISIONS.labels(self.ensemble, self.params.router, member.label).inc()
        call.trace.update({"router": self.params.router, **why, "winner": {"member": member.label}})
        async for d in call.stream(member):
            yield d
