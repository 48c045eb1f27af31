"""``router: semantic``: the prompt's embedding (all-MiniLM-L6-v2) against labelled example prompts per member: the
k nearest examples (cosine) vote, weighted by similarity; if the nearest is below ``threshold``, the ``default``
member answers. Example embeddings are computed once per ensemble and cached."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from chorus.ensembles.call import Call, Member
from chorus.ensembles.fitted.artifact import artifact_path, selectors_dir
from chorus.ensembles.routers.base import ExampleRouter
from chorus.ensembles.similarity import Embedder
from chorus.errors import InvalidRequest


def load_examples(name: str) -> dict[str, list[str]]:
    """Labelled examples from a JSONL file by name in ``$CHORUS_HOME/selectors`` (a request cannot make the server
    read a file anywhere else)."""
    out: dict[str, list[str]] = {}
    path = artifact_path(name, "ensemble.examples_file")
    try:
        lines = path.read_text().splitlines()
    except OSError:
        raise InvalidRequest(f"No examples_file {name!r} in {selectors_dir()}.",
                             param="ensemble.examples_file") from None
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                item = json.loads(line)
                out.setdefault(str(item["member"]), []).append(str(item["prompt"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise InvalidRequest(f"{name}:{n}: need {{\"member\": ..., \"prompt\": ...}}",
                                     param="ensemble.examples_file") from None
    return out


class SemanticParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    examples: dict[str, list[str]] | None = Field(default=None, description="member label -> prompts")
    examples_file: str | None = Field(default=None, description=(
        'JSONL of {"member": ..., "prompt": ...}, by name in $CHORUS_HOME/selectors'))
    k: int = Field(default=5, ge=1, le=100, description="nearest examples that count")
    threshold: float | None = Field(default=None, ge=-1.0, le=1.0,
                                    description="below this best similarity the default member answers")
    default: str | None = Field(default=None, description="member label for unmatched prompts (first)")


class SemanticRouter(ExampleRouter):
    Params = SemanticParams

    def __init__(self, params: SemanticParams, members: list[Member]) -> None:
        super().__init__(params, members)
        labels = [m.label for m in members]
        examples = dict(params.examples or {})
        if params.examples_file:
            for member, prompts in load_examples(params.examples_file).items():
                examples.setdefault(member, []).extend(prompts)
        unknown = sorted(set(examples) - set(labels))
        if unknown:
            raise InvalidRequest(f"examples name unknown members: {', '.join(unknown)}; members are "
                                 f"{', '.join(labels)}.", param="ensemble.examples")
        default = params.default or labels[0]
        if default not in labels:
            raise InvalidRequest(f"'default' must be one of the members: {', '.join(labels)}.",
                                 param="ensemble.default")
        missing = [lb for lb in labels if lb != default and not examples.get(lb)]
        if missing:
            raise InvalidRequest(f"the semantic router needs example prompts for every member but the default; "
                                 f"none for: {', '.join(missing)}.", param="ensemble.examples")
        self.examples = {lb: examples[lb] for lb in labels if examples.get(lb)}
        self.default = next(m for m in members if m.label == default)

    async def choose(self, call: Call, seed: int | None) -> tuple[Member, dict[str, Any]]:
        p = self.params
        embedded = await self.embedded()
        q = (await asyncio.to_thread(Embedder.embed, [call.prompt.question]))[0]  # (384,)
        sims = [(float(s), lb) for lb, e in embedded.items() for s in (e @ q).tolist()]
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
