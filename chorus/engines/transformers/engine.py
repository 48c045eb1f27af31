"""In-process engine: a Hugging Face causal LM on CPU or GPU with continuous batching."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import torch

from chorus.engines.core.base import ServerLoad, TokenLogprob, TopLogprob
from chorus.engines.core.generation import SessionEngine
from chorus.engines.core.hf_tokenizer import HFTokenizer
from chorus.engines.core.request_scope import RequestScope
from chorus.engines.core.spec import ModelSpec, chorus_home
from chorus.engines.runtime.metric import Metric
from chorus.engines.runtime.observer import DenseObserver, FamilyObserver
from chorus.engines.transformers.batching import BatchedSession, BatchRunner
from chorus.engines.transformers.options import TransformersOptions
from chorus.engines.transformers.prefix_store import PrefixStore
from chorus.errors import EngineUnavailable

log = logging.getLogger("chorus.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_CONTEXT_CAP = 4096


def observer_for(model: torch.nn.Module) -> FamilyObserver:
    """The observer of a model's family: MoDr routing, ReasonFormer skills, MoE expert load, or the dense default."""
    from chorus.engines.families.modr import MoDrModel, RoutingObserver  # lazily: torch modules of the families
    from chorus.engines.families.reasonformer import ReasonFormerModel, ReasonObserver

    if isinstance(model, MoDrModel):
        return RoutingObserver(model)
    if isinstance(model, ReasonFormerModel):
        return ReasonObserver(model)
    from chorus.engines.families.moe import ExpertLoad

    return ExpertLoad(model) if ExpertLoad.applies_to(model) else DenseObserver()


class TransformersEngine(SessionEngine):
    def __init__(self, spec: ModelSpec, model: Any, tokenizer: HFTokenizer) -> None:
        self.name = spec.name
        self.spec = spec
        self.model = model
        self.tokenizer = tokenizer
        self.sampling_defaults = spec.sampling_defaults.model_dump(exclude_none=True)
        native = int(getattr(model.config.get_text_config(), "max_position_embeddings", CPU_CONTEXT_CAP))
        default = native if spec.device != "cpu" else min(native, CPU_CONTEXT_CAP)
        self.max_model_len = min(spec.max_model_len or default, native)
        self.observer = observer_for(model)
        opts = spec.options if isinstance(spec.options, TransformersOptions) else TransformersOptions()
        prefix = PrefixStore(opts.prefix_cache_mib << 20, opts.prefix_cache_min_tokens)
        self.runner = BatchRunner(model, max_model_len=self.max_model_len, max_batch_size=spec.max_batch_size,
                                  prefill_chunk=spec.prefill_chunk, observer=self.observer, prefix=prefix)

    async def prompt_logprobs(self, ids: list[int], k: int,
                              scope: RequestScope | None = None) -> list[TokenLogprob | None]:
        """A plain (or grafted) model scores the whole prompt in one forward on the runner's thread, and so
        does a family that decides per sequence (ReasonFormer: on the whole text); other families (MoE expert
        load, MoDr routing) step a session through it (the generic way)."""
        if not (isinstance(self.observer, DenseObserver) or self.observer.decides_on_prompt) or len(ids) < 2:
            return await super().prompt_logprobs(ids, k, scope)
        chosen, top_v, top_i = await self.runner.score(ids, k)
        decode = self.tokenizer.decode
        out: list[TokenLogprob | None] = [None]
        for pos, token in enumerate(ids[1:]):
            out.append(TokenLogprob(decode([token]), token, float(chosen[pos]),
                                    [TopLogprob(decode([int(i)]), float(v)) for i, v in zip(top_i[pos], top_v[pos])]))
        return out

    async def score_continuations(self, prefix: list[int], continuations: list[list[int]],
                                  scope: RequestScope | None = None) -> list[list[float]]:
        """A plain model reads ``prefix`` once: prefix and continuations in one tree-masked forward on the
        runner's thread; a family that decides on the prompt prefills the prefix once and feeds each
        continuation after it; other families (and empty continuations) score each ``prefix + continuation``
        whole."""
        if self.observer.decides_on_prompt and prefix and all(continuations) \
                and len(continuations) <= self.runner.max_batch_size:
            return await self._score_after_prefix(prefix, continuations, scope)
        if not isinstance(self.observer, DenseObserver) or not all(continuations):
            return await super().score_continuations(prefix, continuations, scope)
        return await self.runner.score_continuations(prefix, continuations, scope)

    async def _score_after_prefix(self, prefix: list[int], continuations: list[list[int]],
                                  scope: RequestScope | None) -> list[list[float]]:
        """A family that decides on the prompt (ReasonFormer): as in generation, the prefix is prefilled once
        (the decision is made on it and shared by its sessions) and each continuation is fed after it."""
        pairs = await self.prefill_sessions(prefix, len(continuations), scope=scope)

        async def one(session: BatchedSession, first: torch.Tensor, cont: list[int]) -> list[float]:
            logits = first[None] if len(cont) == 1 else torch.cat([first[None], await session.extend(cont[:-1])])
            logp = torch.log_softmax(logits.float(), -1)  # (len(cont), V)
            return logp.gather(1, torch.tensor(cont)[:, None]).squeeze(1).tolist()

        try:
            return list(await asyncio.gather(*(one(s, lg, c) for (s, lg), c in zip(pairs, continuations))))
        finally:
            for s, _ in pairs:
                s.close()

    @classmethod
    def load(cls, spec: ModelSpec, models: dict[str, ModelSpec] | None = None) -> Any:
        """The engine for a config entry: a causal LM (this class), or a DUMA checkpoint's scorer."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from chorus.engines.families.duma import is_duma_dir
        from chorus.engines.transformers.mapped_pages import release_unused
        from chorus.engines.transformers.prepare import is_prepared

        path = spec.checkpoint_dir(chorus_home())
        if not spec.needs_prepare and is_duma_dir(path):
            from chorus.engines.transformers.scorer import ScorerEngine

            return ScorerEngine.load(spec, models)
        if spec.needs_prepare and not is_prepared(path):
            raise EngineUnavailable(f"model {spec.name!r} is not prepared; run: chorus models prepare {spec.name}")
        if not (path / "config.json").is_file():
            raise EngineUnavailable(f"model {spec.name!r}: no checkpoint at {path}")
        if spec.device.startswith("cuda") and not torch.cuda.is_available():
            raise EngineUnavailable(f"model {spec.name!r} asks for {spec.device} but CUDA is not available")
        from chorus.engines.families.modr import is_modr_dir, load_modr
        from chorus.engines.families.reasonformer import is_reasonformer_dir, load_reasonformer

        t0 = time.perf_counter()
        model: Any
        tok_dir: Path | str
        if is_modr_dir(path):
            assert isinstance(spec.options, TransformersOptions)
            model = load_modr(path, DTYPES[spec.dtype], **spec.options.modr.model_dump(exclude_unset=True))
            tok_dir = model.cfg.base  # its base's tokenizer (the MoDr config.json is not a transformers config)
        elif is_reasonformer_dir(path):
            model = load_reasonformer(path, DTYPES[spec.dtype])
            tok_dir = model.cfg.base
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[spec.dtype], attn_implementation="sdpa")
            tok_dir = path
        hf_tok = AutoTokenizer.from_pretrained(tok_dir)
        if spec.chat_template:
            hf_tok.chat_template = spec.chat_template
        model.to(spec.device).eval()
        gen_cfg = getattr(getattr(model, "base", model), "generation_config", None)
        gen_eos = getattr(gen_cfg, "eos_token_id", None)
        extra = gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
        released = release_unused(model)  # the file pages of weights converted while loading (an MoE's experts)
        log.info("loaded %s from %s in %.1fs%s", spec.name, path, time.perf_counter() - t0,
                 f" ({released / 2**20:.0f} MiB of its mapped file given back)" if released else "")
        return cls(spec, model, HFTokenizer(hf_tok, extra_eos_ids=extra, fallback=spec.fallback_chat))

    async def start(self) -> None:
        self.runner.start()

    async def aclose(self) -> None:
        await self.runner.stop()

    def open_session(self, scope: RequestScope | None = None) -> BatchedSession:
        return BatchedSession(self.runner, scope=scope)

    async def prefill_sessions(self, prompt_ids: list[int], n: int, options: dict[str, Any] | None = None,
                               scope: RequestScope | None = None) -> list[tuple[BatchedSession, torch.Tensor]]:
        """``n`` choices share one prefill: the prompt's KV is computed once and copied into n rows."""
        sessions = self.runner.open_many(n, options, scope)
        try:
            logits = await self.runner.submit_prefill(sessions, prompt_ids)
        except BaseException:
            for s in sessions:
                s.close()
            raise
        return [(s, logits) for s in sessions]

    @property
    def active_sessions(self) -> int:
        return len(self.runner.sessions)

    def server_load(self) -> ServerLoad:
        r = self.runner
        rows = r.rows
        held = sum(s.length for s in rows)
        return ServerLoad(len(r.prefills), len(rows), held / (r.max_model_len * r.max_batch_size))

    async def drop_prefix_cache(self) -> int:
        """Forget every cached prefix (the admin API); the tokens they held."""
        return self.runner.prefix.clear()

    def family_metrics(self) -> list[Metric]:
        """The model family's (`FamilyObserver.metrics`), and the prefix cache's when it is on."""
        c = self.runner.prefix
        return super().family_metrics() + (c.metrics(c.held_tokens, c.held_bytes) if c.enabled else [])

    def stats(self) -> dict[str, int]:
        c = self.runner.prefix
        return {"active_sessions": self.active_sessions, "batch_rows": len(self.runner.rows),
                "forward_steps": self.runner.steps, **(c.stats(c.held_tokens) if c.enabled else {})}
