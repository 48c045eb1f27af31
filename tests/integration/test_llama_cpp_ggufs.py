"""``engine: llama_cpp`` on every GGUF chorus packages or documents, at one and two threads: the engine's logits
equal llama-cpp-python's own (`Llama.eval`, same file, same thread count) alone and in a batch, no logit is
NaN, and a model whose start-up probe gives NaN logits is refused.

SmolLM2's Q4_1 file was the only one tested before; with two threads the K-quant files (Gemma-3 and Qwen2.5 are
Q4_K_M) came out as NaN, because the engine's thread pool ran a second copy of ggml's CPU backend
(`chorus.engines.llama_cpp.threads`). The Qwen pair is opt-in (`make models-qwen`): skipped where its parts are not
installed, like every opt-in model; SmolLM2 and Gemma-3 are packaged and run in CI.
"""

from __future__ import annotations

import asyncio
import ctypes
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import torch

from chorus.config import load_config
from chorus.engines.core.base import GenerationRequest, SamplingParams
from chorus.engines.core.spec import ModelSpec
from chorus.engines.llama_cpp import threads as llama_threads
from chorus.engines.llama_cpp.engine import LlamaCppEngine, gguf_of
from chorus.errors import EngineFailed, EngineUnavailable
from tests.helpers import require
from tests.integration.test_llama_cpp import need_llama_cpp

pytestmark = pytest.mark.integration

PACKAGED = ["smollm2-135m-instruct", "gemma-3-270m"]
OPT_IN = ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "What is 12 times 7? Answer briefly."]
STEPS = 6
# alone, a sequence's logits are llama-cpp-python's bit for bit (same kernels, same shapes). In a batch with other
# sequences they move a little on K-quant files: ggml's CPU backend repacks Q4_K weights into interleaved blocks and
# multiplies them by another kernel when a matmul has four rows or more, whose activation quantization rounds
# differently (measured over these prompts: SmolLM2 Q4_1 0, Gemma-3 1.10, Qwen-0.5B 0.38, Qwen-1.5B 0.63; greedy
# tokens equal). llama.cpp's own server batches the same way.
ALONE_ATOL = 1e-5
BATCHED_ATOL = 1.5


def spec_of(name: str, threads: int) -> ModelSpec:
    base = load_config(None).model(name)
    return ModelSpec.model_validate({"name": f"{name}-llama", "engine": "llama_cpp", "source": base.sources,
                                     "gguf": base.gguf, "max_batch_size": 4, "max_model_len": 512,
                                     "llama_cpp": {"threads": threads}})


def gguf_or_skip(name: str) -> Path:
    try:
        return gguf_of(spec_of(name, 1))
    except EngineUnavailable as exc:
        if name in OPT_IN:
            pytest.skip(f"{name}: opt-in, not installed ({exc}): make models-qwen")
        require(False, f"{name}: {exc}")
        raise


def reference(gguf: Path, threads: int, prompts: list[list[int]]) -> list[tuple[list[int], np.ndarray]]:
    """llama-cpp-python's own logits: each prompt, then STEPS greedy tokens, one eval each; (tokens, rows). Only
    the last token's logits are asked for, as the engine asks: llama.cpp computes the last layer for output rows
    only, and with repacked K-quant weights that other matmul shape rounds differently (up to 1.1 on Gemma-3)."""
    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=512, n_threads=threads, n_threads_batch=threads, logits_all=False,
                flash_attn=True, verbose=False)

    def last() -> np.ndarray:  # the last token's logits (Llama keeps rows only with logits_all)
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),)).copy()

    try:
        out = []
        for ids in prompts:
            llm.reset()
            llm.eval(ids)
            rows = [last()]
            tokens: list[int] = []
            for _ in range(STEPS):
                tokens.append(int(rows[-1].argmax()))
                llm.eval([tokens[-1]])
                rows.append(last())
            out.append((tokens, np.stack(rows)))
        return out
    finally:
        llm.close()


async def greedy(engine: LlamaCppEngine, ids: list[int]) -> tuple[list[int], np.ndarray]:
    s = engine.open_session()
    try:
        logits = await s.prefill(ids)
        tokens, rows = [], [logits]
        for _ in range(STEPS):
            tokens.append(int(logits.argmax()))
            logits = await s.step(tokens[-1])
            rows.append(logits)
        return tokens, torch.stack(rows).numpy()
    finally:
        s.close()


@pytest.fixture(scope="module", params=[(m, t) for m in PACKAGED + OPT_IN for t in (1, 2)],
                ids=lambda p: f"{p[0]}-threads{p[1]}")
async def case(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, int, LlamaCppEngine]]:
    need_llama_cpp()
    name, threads = request.param
    gguf_or_skip(name)
    engine = LlamaCppEngine.load(spec_of(name, threads))
    await engine.start()
    yield name, threads, engine
    await engine.aclose()


async def test_logits_equal_llama_cpp_pythons_alone_and_greedy_tokens_equal_batched(case: tuple[str, int, LlamaCppEngine]) -> None:
    name, threads, engine = case
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    ref = await asyncio.to_thread(reference, gguf_of(engine.spec), threads, prompts)
    alone = [await greedy(engine, ids) for ids in prompts]
    batched = await asyncio.gather(*(greedy(engine, ids) for ids in prompts))
    worst = {"alone": 0.0, "batched": 0.0}
    for (rt, rr), (at, ar), (bt, br) in zip(ref, alone, batched):
        for rows in (rr, ar, br):
            assert np.isfinite(rows).all(), f"{name}: non-finite logits at {threads} threads"
        assert at == rt and bt == rt, f"{name}, {threads} threads: greedy tokens differ from llama-cpp-python's"
        worst["alone"] = max(worst["alone"], float(np.abs(ar - rr).max()))
        worst["batched"] = max(worst["batched"], float(np.abs(br - rr).max()))
    print(f"{name} threads={threads}: max |logit - llama-cpp-python's| alone {worst['alone']:.4g}, "
          f"batched {worst['batched']:.4g}")
    assert worst["alone"] <= ALONE_ATOL  # alone: the same logits (to float rounding)
    # batched: the same greedy tokens (asserted above); the logits only close, within the kernels' rounding
    assert worst["batched"] < BATCHED_ATOL


PROBE_SCRIPT = """
import sys
from llama_cpp._ctypes_extensions import load_shared_library
import llama_cpp
from chorus.engines.llama_cpp import threads as llama_threads
from chorus.engines.llama_cpp.engine import LlamaCppEngine
from chorus.errors import ConfigError
from tests.integration.test_llama_cpp_ggufs import spec_of

bound = llama_threads._ggml
def by_path(lib):
    # what the engine did before: ggml's CPU library loaded by its own path, a second copy of it
    llama, cpu = bound(lib), load_shared_library("ggml-cpu", lib.llama_cpp._base_path)
    for name in ("ggml_threadpool_new", "ggml_threadpool_free"):
        getattr(cpu, name).argtypes = getattr(llama, name).argtypes
        getattr(cpu, name).restype = getattr(llama, name).restype
    class Pools:
        def __getattr__(self, name):
            return getattr(cpu if name in ("ggml_threadpool_new", "ggml_threadpool_free") else llama, name)
    return Pools()
llama_threads._ggml = by_path
try:
    LlamaCppEngine.load(spec_of("gemma-3-270m", 2))
except ConfigError as exc:
    print("refused:", exc)
    sys.exit(0)
print("served", llama_threads.ggml_copies())
sys.exit(1)
"""


def test_a_model_whose_probe_gives_nan_is_refused() -> None:
    """The old fault, reproduced in a process of its own (it maps a second copy of ggml's CPU library): the pool
    made in that copy gives Gemma-3 NaN logits at two threads, and the engine refuses the model at load."""
    need_llama_cpp()
    gguf_or_skip("gemma-3-270m")
    run = subprocess.run([sys.executable, "-c", PROBE_SCRIPT], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).parents[2])
    assert run.returncode == 0, run.stdout + run.stderr
    assert "start-up probe" in run.stdout and "NaN" in run.stdout


async def test_the_thread_pool_runs_the_ggml_libllama_uses(case: tuple[str, int, LlamaCppEngine]) -> None:
    """One copy of ggml's CPU library in the process, the pool attached (the engine's default)."""
    assert case[2].pools is not None
    if sys.platform.startswith("linux"):
        assert len(llama_threads.ggml_copies()) == 1, llama_threads.ggml_copies()


class NaNLogits:
    """llama-cpp-python's module with every logits row read as NaN (what the faulty pool gave)."""

    def __init__(self, lib: object, n_vocab: int) -> None:
        self._lib = lib
        self._row = (ctypes.c_float * n_vocab)(*([float("nan")] * n_vocab))

    def __getattr__(self, name: str) -> object:
        return getattr(self._lib, name)

    def llama_get_logits_ith(self, ctx: object, i: int) -> object:
        return ctypes.cast(self._row, ctypes.POINTER(ctypes.c_float))


async def test_a_nan_row_fails_the_request_and_is_never_sampled() -> None:
    need_llama_cpp()
    engine = LlamaCppEngine.load(spec_of("smollm2-135m-instruct", 2))
    await engine.start()
    try:
        ids = engine.tokenizer.encode("The capital of France is")
        s = engine.open_session()
        logits = await s.prefill(ids)
        engine.runner.lib = NaNLogits(engine.runner.lib, engine.runner.n_vocab)
        with pytest.raises(EngineFailed, match="not numbers"):  # a step: the row comes back to the event loop
            await s.step(int(logits.argmax()))
        s.close()
        req = GenerationRequest(prompt_ids=ids, params=SamplingParams(temperature=0.0, max_tokens=8))
        with pytest.raises(EngineFailed, match="not numbers"):  # a plain choice, sampled on the decode thread
            await engine.generate(req)
    finally:
        await engine.aclose()
