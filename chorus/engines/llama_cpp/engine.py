"""``engine: llama_cpp``: a GGUF model in-process through llama-cpp-python, with continuous batching.

The GGUF is loaded as it is (memory-mapped, quantized weights kept quantized). Sequences share one
context (`llama_runner.LlamaRunner`), each with its own KV cells, so this engine's sessions are ordinary
`Session`s: the decode loop, sampling, stop strings, logprobs, grammars, logit averaging, speculation and
prompt scoring are the ones every session engine uses. The tokenizer (and chat template) is the model's
own from the GGUF, through transformers, so token ids and rendered prompts are those of the transformers
engine on the same file and the two can be mixed in token-level ensembles.

Options (the model's ``llama_cpp:`` map): ``n_ctx`` (llama.cpp's KV cells, split evenly over the
``max_batch_size`` sequences; default ``max_model_len`` x ``max_batch_size``), ``n_batch`` (tokens per decode,
default 512, also the prefill chunk), ``threads`` (default: the machine's cores) and ``threads_batch`` (for
prompts; default ``threads``), ``poll`` (0 to 100, default 50: how long the pool's threads spin for the next
decode before they sleep, `llama_threads`). ``max_model_len`` bounds one sequence (default: the model's
training context, capped at 4096; at most ``n_ctx / max_batch_size``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from chorus.engines.core.base import ServerLoad, Session, TokenLogprob
from chorus.engines.core.generation import SessionEngine, token_logprob
from chorus.engines.core.hf_tokenizer import HFTokenizer
from chorus.engines.core.request_scope import RequestScope
from chorus.engines.core.spec import ModelSpec, chorus_home
from chorus.engines.llama_cpp.options import LlamaCppOptions
from chorus.engines.llama_cpp.runner import LlamaRunner
from chorus.engines.llama_cpp.session import LlamaSession
from chorus.engines.llama_cpp.threads import ThreadPools
from chorus.engines.runtime.metric import Metric
from chorus.errors import ConfigError, EngineUnavailable, InvalidRequest

log = logging.getLogger("chorus.engine")
CONTEXT_CAP = 4096
PROBE = "The capital of France is"  # the start-up probe: its logits must be finite
_STATE: dict[str, Any] = {}  # the initialised library and its log callback (llama.cpp keeps the pointer)


def _quiet(level: int, text: bytes, user_data: Any) -> None:
    """llama.cpp's warnings and errors into chorus's log (ggml: 3 = warn, 4 = error); its chatter stays out."""
    message = text.decode(errors="replace").rstrip()
    if level == 4:
        log.error("llama.cpp: %s", message)
    elif level == 3:
        log.warning("llama.cpp: %s", message)


def _library() -> Any:
    """llama_cpp, its backend initialised once, its log routed to chorus's (errors only)."""
    if "lib" in _STATE:
        return _STATE["lib"]
    try:
        import llama_cpp
    except ImportError as exc:
        raise EngineUnavailable("engine: llama_cpp needs llama-cpp-python: pip install 'chorus-gateway[llama-cpp]' "
                                f"(or make llama-cpp; it builds llama.cpp, about 8 minutes) ({exc})") from None
    _STATE["log"] = llama_cpp.llama_log_callback(_quiet)
    llama_cpp.llama_log_set(_STATE["log"], ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    _STATE["lib"] = llama_cpp
    return llama_cpp


def probe(lib: Any, ctx: Any, ids: list[int], n_vocab: int) -> str | None:
    """Decode ``ids`` on sequence 0 of a fresh context and read the last token's logits; None when every one is
    a finite number, else what is wrong ("12 NaN logits"). The sequence's cells are cleared afterwards."""
    batch = lib.llama_batch_init(len(ids), 0, 1)
    try:
        for i, token in enumerate(ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i == len(ids) - 1
        batch.n_tokens = len(ids)
        rc = lib.llama_decode(ctx, batch)
        if rc != 0:
            return f"llama_decode error {rc}"
        row = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, len(ids) - 1), shape=(n_vocab,))
        nan, inf = int(np.isnan(row).sum()), int(np.isinf(row).sum())
        return None if nan == inf == 0 else f"{nan} NaN and {inf} infinite logits of {n_vocab}"
    finally:
        lib.llama_batch_free(batch)
        lib.llama_memory_seq_rm(lib.llama_get_memory(ctx), 0, -1, -1)


def gguf_of(spec: ModelSpec) -> Path:
    from chorus.engines.core.sources import resolve_gguf

    return resolve_gguf(spec, chorus_home())


def tokenizer_for(spec: ModelSpec, gguf: Path) -> HFTokenizer:
    """The model's tokenizer: the prepared checkpoint's when there is one (what the transformers engine reads),
    else read from the GGUF."""
    from transformers import AutoTokenizer

    prepared = spec.prepared_dir(chorus_home())
    if (prepared / "tokenizer_config.json").is_file():
        hf = AutoTokenizer.from_pretrained(prepared)
    else:
        hf = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if spec.chat_template:
        hf.chat_template = spec.chat_template
    return HFTokenizer(hf, fallback=spec.fallback_chat)


class LlamaCppEngine(SessionEngine):
    def __init__(self, spec: ModelSpec, lib: Any, model: Any, ctx: Any, pools: ThreadPools | None,
                 tokenizer: HFTokenizer, *, max_model_len: int, n_batch: int, n_vocab: int) -> None:
        self.name = spec.name
        self.spec = spec
        self.lib = lib
        self.model = model
        self.ctx = ctx
        self.pools = pools
        self.tokenizer = tokenizer
        self.sampling_defaults = spec.sampling_defaults.model_dump(exclude_none=True)
        self.max_model_len = max_model_len
        opts = spec.options
        assert isinstance(opts, LlamaCppOptions)
        self.runner = LlamaRunner(lib, ctx, n_vocab=n_vocab, max_model_len=max_model_len,
                                  max_batch_size=spec.max_batch_size, n_batch=n_batch,
                                  cache_slots=opts.prefix_cache_slots, cache_min_tokens=opts.prefix_cache_min_tokens)

    @classmethod
    def load(cls, spec: ModelSpec, models: dict[str, ModelSpec] | None = None) -> LlamaCppEngine:
        opts = spec.options
        assert isinstance(opts, LlamaCppOptions)
        lib = _library()
        gguf = gguf_of(spec)
        t0 = time.perf_counter()
        mparams = lib.llama_model_default_params()
        mparams.use_mmap = True
        model = lib.llama_model_load_from_file(str(gguf).encode(), mparams)
        if not model:
            raise ConfigError(f"model {spec.name!r}: llama.cpp cannot load the GGUF {gguf} (see the log for why)")
        native = int(lib.llama_model_n_ctx_train(model))
        n_batch = opts.n_batch
        per_seq = min(spec.max_model_len or min(native, CONTEXT_CAP), native)
        # the sequences that decode, then the prefix cache's (each a KV stream of max_model_len cells)
        n_seq = spec.max_batch_size + opts.prefix_cache_slots
        n_ctx = opts.n_ctx or per_seq * n_seq
        max_model_len = min(per_seq, n_ctx // n_seq)
        if max_model_len < 16:
            lib.llama_model_free(model)
            raise ConfigError(f"model {spec.name!r}: llama_cpp.n_ctx {n_ctx} leaves {max_model_len} cells to each of "
                              f"{n_seq} sequences ({spec.max_batch_size} decoding, {opts.prefix_cache_slots} "
                              "for the prefix cache)")
        threads = opts.threads or os.cpu_count() or 1
        threads_batch = opts.threads_batch or threads
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_seq_max = n_seq
        cparams.n_threads = threads
        cparams.n_threads_batch = threads_batch
        cparams.kv_unified = False  # each sequence its own cells (measured: the unified cache changes a
        # sequence's logits by up to 0.9 with where its cells lie; split, batched equals alone exactly)
        ctx = lib.llama_init_from_model(model, cparams)
        if not ctx:
            lib.llama_model_free(model)
            raise ConfigError(f"model {spec.name!r}: llama.cpp cannot create a context for {gguf} (n_ctx {n_ctx})")
        pools = ThreadPools.attach(lib, ctx, threads, threads_batch, opts.poll)
        n_vocab = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model)))
        tokenizer = tokenizer_for(spec, gguf)
        bad_probe = probe(lib, ctx, tokenizer.encode(PROBE), n_vocab)
        if bad_probe:
            if pools is not None:
                pools.close()
            lib.llama_free(ctx)
            lib.llama_model_free(model)
            raise ConfigError(f"model {spec.name!r}: llama.cpp's start-up probe ({PROBE!r}, {threads} threads) gave "
                              f"{bad_probe}; chorus does not serve a model whose logits are not numbers. Try "
                              "llama_cpp: {threads: 1}, and report the build (docs/configuration.md)")
        if n_vocab != tokenizer.vocab_size:
            log.warning("%s: llama.cpp has %d tokens, the tokenizer %d", spec.name, n_vocab, tokenizer.vocab_size)
        log.info("loaded %s from %s (llama.cpp, mmap) in %.1fs", spec.name, gguf, time.perf_counter() - t0)
        return cls(spec, lib, model, ctx, pools, tokenizer, max_model_len=max_model_len, n_batch=n_batch, n_vocab=n_vocab)

    async def start(self) -> None:
        self.runner.start()

    async def aclose(self) -> None:
        await self.runner.stop()
        if self.ctx is not None:
            if self.pools is not None:
                self.pools.close()
            self.lib.llama_free(self.ctx)
            self.lib.llama_model_free(self.model)
            self.ctx = self.model = None

    def open_session(self, scope: RequestScope | None = None) -> LlamaSession:
        return LlamaSession(self.runner, scope)

    @property
    def active_sessions(self) -> int:
        return len(self.runner.sessions)

    def server_load(self) -> ServerLoad:
        r = self.runner
        held = sum(s.length for s in r.decoding)
        return ServerLoad(len(r.waiting), len(r.decoding), held / (r.max_model_len * r.max_batch_size))

    async def drop_prefix_cache(self) -> int:
        """Forget every cached prefix (the admin API); the tokens they held."""
        return await self.runner.drop_cache()

    def family_metrics(self) -> list[Metric]:
        """The prefix cache since start-up: lookups that hit and missed, prompt tokens served from it, evictions
        (counters), and the tokens and KV bytes it holds now (gauges)."""
        c = self.runner.cache
        return c.metrics(c.held_tokens, c.held_tokens * c.bytes_per_token) if c.enabled else []

    def stats(self) -> dict[str, int]:
        cache = self.runner.cache
        return {"active_sessions": self.active_sessions, "decode_steps": self.runner.steps,
                "free_sequences": len(self.runner.free_seqs), **cache.stats(cache.held_tokens)}

    async def prefill_sessions(self, prompt_ids: list[int], n: int, options: dict[str, Any] | None = None,
                               scope: RequestScope | None = None) -> Sequence[tuple[Session, torch.Tensor]]:
        """``n`` sequences of one prompt: the prompt is prefilled once, in the first, and its KV cells are copied
        into the others (``llama_memory_seq_cp``: one copy of the sequence's cells, no compute), so n samples cost
        one prefill and n decodes. They are opened together (they take their sequence ids together); more than
        the context's sequences (``max_batch_size``) could never be held at once (the request would wait for
        itself), so that is a 400, as on the transformers engine."""
        if n > self.spec.max_batch_size:
            raise InvalidRequest(f"n={n} exceeds the engine's batch size {self.spec.max_batch_size}", param="n")
        if n == 1:
            return await super().prefill_sessions(prompt_ids, n, options, scope)
        sessions = [self.open_session(scope) for _ in range(n)]
        try:
            row = await sessions[0].prefill(prompt_ids)
            await self.runner.fork(sessions[0], sessions[1:])
        except BaseException:
            for s in sessions:
                s.close()
            raise
        return [(s, row) for s in sessions]

    async def prompt_logprobs(self, ids: list[int], k: int,
                              scope: RequestScope | None = None) -> list[TokenLogprob | None]:
        """The whole prompt in one session, prefilled in prefill-sized batches that keep every token's logits
        (`LlamaSession.score`), not a step per token nor an extend's small chunks."""
        if len(ids) < 2:
            return await super().prompt_logprobs(ids, k, scope)
        session = self.open_session(scope)
        try:
            rows = await session.score(ids[:-1])
            return [None, *(token_logprob(self.tokenizer, rows[i], t, k) for i, t in enumerate(ids[1:]))]
        finally:
            session.close()
