"""Shared-vocabulary logit averaging (methods.md section 1).

One session (own KV cache) per member per request. Each step combines the members' next-token
distributions with normalised weights, in probability space (``p = sum_i w_i softmax(z_i)``, the
default) or logit space (``z = sum_i w_i z_i``); the decode loop's sampling then acts on the combined
distribution, and the chosen token is fed to every member. Because members' sessions live in their
engines' batch runners, concurrent ensemble requests batch like single-model ones.

`LogitAverage` is itself an engine (a `SessionEngine`), so generation, streaming, stop strings, n,
seeds and logprobs work exactly as for one model.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence

import torch

from engines.base import LOGITS, Engine, Session
from engines.errors import CapabilityMismatch, InvalidRequest
from engines.generation import SessionEngine

SPACES = ("probability", "logit")


class AveragedSession:
    def __init__(self, members: list[Session], weights: torch.Tensor, space: str, vocab: int,
                 on_close: Callable[[AveragedSession], None] | None = None) -> None:
        self.members = members
        self.weights = weights  # (M,)
        self.space = space
        self.vocab = vocab
        self._on_close = on_close

    @property
    def length(self) -> int:
        return self.members[0].length

    def combine(self, logits: Sequence[torch.Tensor]) -> torch.Tensor:
        z = torch.stack([x[: self.vocab].float() for x in logits])  # (M, V)
        if self.space == "logit":
            return (self.weights[:, None] * z).sum(0)
        p = (self.weights[:, None] * torch.softmax(z, dim=-1)).sum(0)  # (V,)
        return torch.log(p.clamp_min(1e-30))  # log-probabilities: sampling acts on p itself

    async def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        return self.combine(await asyncio.gather(*(m.prefill(ids) for m in self.members)))

    async def step(self, token: int) -> torch.Tensor:
        return self.combine(await asyncio.gather(*(m.step(token) for m in self.members)))

    def close(self) -> None:
        for m in self.members:
            m.close()
        if self._on_close is not None:
            self._on_close(self)


class LogitAverage(SessionEngine):
    requires = frozenset({LOGITS})

    def __init__(self, members: list[Engine], weights: Sequence[float] | None = None,
                 space: str = "probability", name: str = "logit_average") -> None:
        if len(members) < 2:
            raise InvalidRequest("logit_average needs at least 2 members.", param="ensemble.members")
        lacking = [m.name for m in members if LOGITS not in m.capabilities]
        if lacking:
            raise CapabilityMismatch(f"logit_average needs full logits; these members cannot give them: "
                                     f"{', '.join(lacking)}.", param="ensemble.members")
        base = members[0].tokenizer.fingerprint
        differ = [m.name for m in members if m.tokenizer.fingerprint != base]
        if differ:
            raise CapabilityMismatch(
                f"logit_average needs members that share one vocabulary; {', '.join(differ)} differ from "
                f"{members[0].name}. Use \"align\": \"topk_union\" to ensemble different vocabularies.",
                param="ensemble.members")
        if space not in SPACES:
            raise InvalidRequest(f"'space' must be one of {', '.join(SPACES)}.", param="ensemble.space")
        w = list(weights) if weights is not None else [1.0] * len(members)
        if len(w) != len(members) or any(not math.isfinite(x) or x < 0 for x in w) or sum(w) <= 0:
            raise InvalidRequest(f"'weights' must be {len(members)} non-negative numbers with a positive sum.",
                                 param="ensemble.weights")
        self.name = name
        self.members = members
        self.weights = torch.tensor(w, dtype=torch.float32) / sum(w)
        self.space = space
        self.tokenizer = members[0].tokenizer
        self.max_model_len = min(m.max_model_len for m in members)
        self.vocab = self.tokenizer.vocab_size
        self._open: set[AveragedSession] = set()

    def open_session(self) -> AveragedSession:
        session = AveragedSession([m.open_session() for m in self.members], self.weights, self.space, self.vocab,
                                  on_close=self._open.discard)
        self._open.add(session)
        return session

    @property
    def active_sessions(self) -> int:
        return len(self._open)
