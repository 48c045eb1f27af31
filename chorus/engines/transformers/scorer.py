"""Scorer models: a trained multiple-choice scorer (DUMA, engines/families/duma.py) served as a model.

A config entry whose ``path:`` is a DUMA checkpoint loads as a `ScorerEngine`. It has one capability,
``choices``: it gives one logit per option of a prompt (``score_options``), which ``/v1/choices`` turns
into probabilities and which a ``choice_average`` ensemble averages with LLMs' probabilities. It
generates nothing: chat, completions and token sessions refuse it with a 400 naming what it does.
Forwards run one at a time on a worker thread (the event loop keeps serving); concurrent requests
queue behind it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from chorus.engines.core.base import CHOICES
from chorus.engines.core.no_text import GeneratesNothing
from chorus.engines.core.request_scope import RequestScope
from chorus.engines.core.spec import ModelSpec
from chorus.errors import CapabilityMismatch, EngineUnavailable, InvalidRequest

log = logging.getLogger("chorus.engine")


class ScorerEngine(GeneratesNothing):
    capabilities = frozenset({CHOICES})
    sampling_defaults: dict[str, float] = {}  # noqa: RUF012 - read-only, no sampling

    def __init__(self, spec: ModelSpec, model: Any, tokenizer: Any) -> None:
        self.name = spec.name
        self.spec = spec
        self.model = model
        self.hf_tokenizer = tokenizer
        self.device = spec.device
        self.max_model_len = int(model.cfg.max_length)
        cfg = model.cfg
        self.kind = "DUMA, " + ("baseline head" if cfg.head == "baseline" else f"co-attention head, fuse {cfg.fuse}")
        #: what ``/v1/models`` says about the scorer
        self.description = {"family": "duma", "head": cfg.head, "fuse": None if cfg.head == "baseline" else cfg.fuse,
                            "encoder": cfg.encoder, "max_length": cfg.max_length}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"scorer-{spec.name}")
        self.calls = 0
        self.options_scored = 0

    @classmethod
    def load(cls, spec: ModelSpec, models: dict[str, ModelSpec] | None = None) -> ScorerEngine:
        from chorus.engines.families.duma import load_duma

        if spec.device.startswith("cuda") and not torch.cuda.is_available():
            raise EngineUnavailable(f"model {spec.name!r} asks for {spec.device} but CUDA is not available")
        t0 = time.perf_counter()
        model, tokenizer = load_duma(spec.checkpoint_dir(), getattr(torch, spec.dtype))
        model.to(spec.device)
        log.info("loaded scorer %s from %s in %.1fs", spec.name, spec.path, time.perf_counter() - t0)
        return cls(spec, model, tokenizer)

    def refuse(self, what: str, param: str = "model") -> CapabilityMismatch:
        return CapabilityMismatch(f"The model '{self.name}' is a multiple-choice scorer ({self.kind}): it only scores "
                                  f"choices (POST /v1/choices, or as a member of a 'choice_average' ensemble); it "
                                  f"cannot {what}.", param=param)

    def _forward(self, prompt: str, options: list[str]) -> tuple[list[float], int]:
        from chorus.engines.families.duma import encode_pairs

        batch = encode_pairs(self.hf_tokenizer, [prompt] * len(options), options, self.max_model_len)
        tokens = int(batch["attention_mask"].sum())
        with torch.inference_mode():
            logits = self.model(**{k: v.to(self.device) for k, v in batch.items()})
        return [float(x) for x in logits.float().cpu()], tokens

    async def score_options(self, prompt: str, options: Sequence[str]) -> tuple[list[float], int]:
        """One logit per option after ``prompt`` (softmax them for probabilities) and the tokens read. Pairs
        longer than the scorer's ``max_length`` are truncated as in training; a prompt with no text is a 400."""
        if not prompt.strip():
            raise InvalidRequest(f"The scorer '{self.name}' needs a prompt with text (the passage / question).",
                                 param="prompt")
        for i, o in enumerate(options):
            if not o.strip():
                raise InvalidRequest(f"choices[{i}] is empty; the scorer reads each option's text.", param="choices")
        self.calls += 1
        self.options_scored += len(options)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._forward, prompt, list(options))

    async def score_continuations(self, prefix: list[int], continuations: list[list[int]],
                                  scope: RequestScope | None = None) -> list[list[float]]:
        raise self.refuse("score token continuations (it scores whole options: score_options)", "choices")

    async def aclose(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> dict[str, int]:
        return {"calls": self.calls, "options_scored": self.options_scored}
