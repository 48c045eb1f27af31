"""A persistent ggml thread pool for a llama.cpp context, as llama.cpp's own tools attach one.

Without one, ggml's CPU backend starts ``threads - 1`` new threads for every ``llama_decode`` and joins them at
its end (llama-cpp-python attaches none: its binding leaves ``llama_attach_threadpool`` out). A pool keeps
its threads between decodes; after a decode they poll for the next one for a while (``poll``, ggml's 0 to
100; llama.cpp's default 50), then sleep. llama-cpp-python does not bind these calls, so they are declared
here on the libraries it ships (ggml's ABI of the vendored llama.cpp: ``ggml.h``, ``ggml-cpu.h``).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

log = logging.getLogger("chorus.llama_cpp")
MAX_THREADS = 512  # GGML_MAX_N_THREADS: the size of the params' cpumask


class PoolParams(ctypes.Structure):
    """``struct ggml_threadpool_params``."""

    _fields_ = [("cpumask", ctypes.c_bool * MAX_THREADS), ("n_threads", ctypes.c_int), ("prio", ctypes.c_int),
                ("poll", ctypes.c_uint32), ("strict_cpu", ctypes.c_bool), ("paused", ctypes.c_bool)]


def _ggml(llama_cpp: Any) -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """ggml's base and CPU libraries beside llama-cpp-python's libllama (already loaded by it), found the way
    llama-cpp-python finds its own (the platform's suffix, ``LLAMA_CPP_LIB_PATH``)."""
    from llama_cpp._ctypes_extensions import load_shared_library

    where = llama_cpp.llama_cpp._base_path
    base = load_shared_library("ggml-base", where)
    cpu = load_shared_library("ggml-cpu", where)
    base.ggml_threadpool_params_init.argtypes = [ctypes.POINTER(PoolParams), ctypes.c_int]
    base.ggml_threadpool_params_init.restype = None
    cpu.ggml_threadpool_new.argtypes = [ctypes.POINTER(PoolParams)]
    cpu.ggml_threadpool_new.restype = ctypes.c_void_p
    cpu.ggml_threadpool_free.argtypes = [ctypes.c_void_p]
    cpu.ggml_threadpool_free.restype = None
    llama = llama_cpp.llama_cpp._lib
    llama.llama_attach_threadpool.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    llama.llama_attach_threadpool.restype = None
    llama.llama_detach_threadpool.argtypes = [ctypes.c_void_p]
    llama.llama_detach_threadpool.restype = None
    return base, cpu


class ThreadPools:
    """One pool for single-token decodes (``threads``) and one for prompt batches (``threads_batch``), shared
    when the two counts are equal (as llama.cpp's tools do); `close` detaches and frees them."""

    @classmethod
    def attach(cls, llama_cpp: Any, ctx: Any, threads: int, threads_batch: int, poll: int) -> ThreadPools | None:
        """The pools, attached; None (with a warning: decodes then start their own threads, as before) where
        this build's ggml libraries cannot be found or bound, or ggml cannot start the threads."""
        try:
            return cls(llama_cpp, ctx, threads, threads_batch, poll)
        except (OSError, RuntimeError, AttributeError, ImportError) as exc:
            log.warning("llama.cpp: no persistent thread pool (%s): each decode starts its own threads", exc)
            return None

    def __init__(self, llama_cpp: Any, ctx: Any, threads: int, threads_batch: int, poll: int) -> None:
        self._base, self._cpu = _ggml(llama_cpp)
        self._llama = llama_cpp.llama_cpp._lib
        self._ctx = ctx
        self.pools: list[int] = []
        try:
            for count in dict.fromkeys((threads, threads_batch)):  # one pool when the counts are equal
                self.pools.append(self._new(count, poll))
        except RuntimeError:
            self._free()
            raise
        self._llama.llama_attach_threadpool(ctx, self.pools[0], self.pools[-1])

    def _new(self, threads: int, poll: int) -> int:
        params = PoolParams()
        self._base.ggml_threadpool_params_init(ctypes.byref(params), threads)
        params.poll = poll
        pool = self._cpu.ggml_threadpool_new(ctypes.byref(params))
        if not pool:
            raise RuntimeError(f"ggml could not start a pool of {threads} threads")
        return int(pool)

    def _free(self) -> None:
        for pool in self.pools:
            self._cpu.ggml_threadpool_free(pool)
        self.pools = []

    def close(self) -> None:
        """Detach (the context's decodes fall back to per-decode threads) and free; the context outlives this."""
        if self.pools:
            self._llama.llama_detach_threadpool(self._ctx)
            self._free()
