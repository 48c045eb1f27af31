"""A persistent ggml thread pool for a llama.cpp context, as llama.cpp's own tools attach one.

Without one, ggml's CPU backend starts ``threads - 1`` new threads for every ``llama_decode`` and joins them at
its end (llama-cpp-python attaches none: its binding leaves ``llama_attach_threadpool`` out). A pool keeps
its threads between decodes; after a decode they poll for the next one for a while (``poll``, ggml's 0 to
100; llama.cpp's default 50), then sleep. llama-cpp-python does not bind these calls, so they are declared
here (ggml's ABI of the vendored llama.cpp: ``ggml.h``, ``ggml-cpu.h``), looked up through libllama (`_ggml` says
why that matters).
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


def _ggml(llama_cpp: Any) -> ctypes.CDLL:
    """libllama, as llama-cpp-python loaded it, with ggml's thread-pool calls bound on it.

    The calls live in ggml's base and CPU libraries, which libllama links by their sonames (``libggml-cpu.so.0``).
    A pip install copies each library under every name of its symlink chain, so loading ``libggml-cpu.so`` by
    path maps a second, separate copy of ggml's CPU backend: a pool made there runs that copy's compute code,
    which never ran its CPU initialisation and does not know the weights this context repacked at load
    (K-quants are repacked into interleaved blocks on AVX2 / AVX-512): Q4_K_M models gave NaN or garbage with
    more than one thread. Looking the symbols up on libllama's own handle resolves them, as the dynamic linker
    does for libllama itself, in the copy it uses (dlsym searches a handle's dependencies too)."""
    llama = llama_cpp.llama_cpp._lib
    llama.ggml_threadpool_params_init.argtypes = [ctypes.POINTER(PoolParams), ctypes.c_int]
    llama.ggml_threadpool_params_init.restype = None
    llama.ggml_threadpool_new.argtypes = [ctypes.POINTER(PoolParams)]
    llama.ggml_threadpool_new.restype = ctypes.c_void_p
    llama.ggml_threadpool_free.argtypes = [ctypes.c_void_p]
    llama.ggml_threadpool_free.restype = None
    llama.llama_attach_threadpool.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    llama.llama_attach_threadpool.restype = None
    llama.llama_detach_threadpool.argtypes = [ctypes.c_void_p]
    llama.llama_detach_threadpool.restype = None
    return llama


def ggml_copies() -> list[str]:
    """The files of ggml's CPU backend mapped into this process (Linux; empty elsewhere): one, unless a second
    copy was loaded by another path (the cause of the K-quant NaNs above)."""
    try:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps if "libggml-cpu" in line})
    except OSError:
        return []


class ThreadPools:
    """One pool for single-token decodes (``threads``) and one for prompt batches (``threads_batch``), shared
    when the two counts are equal (as llama.cpp's tools do); `close` detaches and frees them."""

    @classmethod
    def attach(cls, llama_cpp: Any, ctx: Any, threads: int, threads_batch: int, poll: int) -> ThreadPools | None:
        """The pools, attached; None (with a warning: decodes then start their own threads, as before) where
        this build's ggml calls cannot be bound, or ggml cannot start the threads."""
        try:
            return cls(llama_cpp, ctx, threads, threads_batch, poll)
        except (OSError, RuntimeError, AttributeError, ImportError) as exc:
            log.warning("llama.cpp: no persistent thread pool (%s): each decode starts its own threads", exc)
            return None

    def __init__(self, llama_cpp: Any, ctx: Any, threads: int, threads_batch: int, poll: int) -> None:
        self._llama = _ggml(llama_cpp)
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
        self._llama.ggml_threadpool_params_init(ctypes.byref(params), threads)
        params.poll = poll
        pool = self._llama.ggml_threadpool_new(ctypes.byref(params))
        if not pool:
            raise RuntimeError(f"ggml could not start a pool of {threads} threads")
        return int(pool)

    def _free(self) -> None:
        for pool in self.pools:
            self._llama.ggml_threadpool_free(pool)
        self.pools = []

    def close(self) -> None:
        """Detach (the context's decodes fall back to per-decode threads) and free; the context outlives this."""
        if self.pools:
            self._llama.llama_detach_threadpool(self._ctx)
            self._free()
