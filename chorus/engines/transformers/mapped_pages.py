"""The pages of a checkpoint's mapped safetensors file that no weight uses once the model is loaded, given back.

transformers maps a safetensors file and keeps the tensors it can use as they are in that mapping (no copy). A
weight it converts while loading (an MoE's experts, fused into one tensor per layer; a dtype cast) is read from
the mapping, copied, and never read there again, but its pages stay resident in the mapping as long as the
mapping lives, which is as long as the model: the upcycled SmolLM2 MoE held 1.2 GB of its file resident besides
its 1.6 GB of converted experts. `release_unused` tells the kernel (``madvise(MADV_DONTNEED)``) that the parts
of each mapped safetensors file that no parameter or buffer points into are not needed: the mapping drops those
pages (they would be read again from the file if anything touched them; the pages of the weights in use, and a page
partly in use, are never touched). Linux only; elsewhere, or where the mapping cannot be read, nothing is done."""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
from typing import Any

log = logging.getLogger("chorus.engine")
MADV_DONTNEED = 4


def safetensors_mappings() -> list[tuple[int, int, str]]:
    """(start, end, path) of this process's mappings of ``.safetensors`` files (transformers maps them private
    and writable: copy-on-write, so a page no weight points into holds nothing anyone needs)."""
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].rstrip().endswith(".safetensors"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi, parts[5].rstrip()))
    return out


def used_ranges(model: Any) -> list[tuple[int, int]]:
    """The address ranges of the model's parameters' and buffers' storages, sorted."""
    spans = set()
    for t in [*model.parameters(), *model.buffers()]:
        storage = t.untyped_storage()
        if storage.device.type == "cpu" and storage.nbytes():
            spans.add((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return sorted(spans)


def unused_pages(lo: int, hi: int, used: list[tuple[int, int]], page: int) -> list[tuple[int, int]]:
    """The whole pages of [lo, hi) that no used range touches (a page partly used is kept)."""
    gaps, at = [], lo
    for a, b in used:
        if b <= lo or a >= hi:
            continue
        if a > at:
            gaps.append((at, a))
        at = max(at, b)
    if at < hi:
        gaps.append((at, hi))
    out = []
    for a, b in gaps:
        a, b = -(-a // page) * page, b // page * page  # inward to whole pages
        if b > a:
            out.append((a, b))
    return out


def release_unused(model: Any) -> int:
    """Give back the pages of mapped safetensors files that no weight of ``model`` uses; returns the bytes."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        mappings = safetensors_mappings()
        if not mappings:
            return 0
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        used = used_ranges(model)
        released = 0
        for lo, hi, _path in mappings:
            if not any(a < hi and b > lo for a, b in used):
                continue  # another model's file (or one being loaded): not this model's to judge
            for a, b in unused_pages(lo, hi, used, mmap.PAGESIZE):
                if libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), MADV_DONTNEED) == 0:
                    released += b - a
        return released
    except (OSError, AttributeError) as exc:  # no /proc, no libc symbol: the pages stay where they are
        log.debug("mapped pages not released: %s", exc)
        return 0
