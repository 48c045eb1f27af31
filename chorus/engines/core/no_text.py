"""The text-generation side of the Engine protocol for models that generate nothing (the DUMA scorer, embedding
models): every call is a 400 from the model's own ``refuse(what, param)``, naming what it does instead."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from chorus.engines.core.base import Delta, Generation, GenerationRequest, Session, Tokenizer, TokenLogprob
from chorus.engines.core.request_scope import RequestScope
from chorus.engines.runtime.metric import Metric
from chorus.errors import CapabilityMismatch


class GeneratesNothing:
    def refuse(self, what: str, param: str = "model") -> CapabilityMismatch:
        raise NotImplementedError

    @property
    def tokenizer(self) -> Tokenizer:
        raise self.refuse("tokenize text for generation")

    def open_session(self, scope: RequestScope | None = None) -> Session:
        raise self.refuse("open a token session")

    async def generate(self, request: GenerationRequest) -> Generation:
        raise self.refuse("generate text")

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[Delta, None]:
        raise self.refuse("generate text")
        yield  # pragma: no cover - makes this an async generator

    async def prompt_logprobs(self, ids: list[int], k: int,
                              scope: RequestScope | None = None) -> list[TokenLogprob | None]:
        raise self.refuse("score prompt tokens", "echo")

    async def start(self) -> None:
        pass

    @property
    def active_sessions(self) -> int:
        return 0

    def placement(self) -> dict[str, Any]:
        return {"runs": "in-process"}

    def family_metrics(self) -> list[Metric]:
        return []
