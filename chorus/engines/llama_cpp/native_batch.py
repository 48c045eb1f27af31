"""One ``llama_batch`` filled from the planned feeds, and the logits rows read back after ``llama_decode``: the two
halves of the runner's decode (runner.py) that touch llama.cpp's buffers, on the decode thread."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

from chorus.engines.llama_cpp.session import Feed


def fill_batch(b: Any, feeds: list[Feed]) -> list[list[int]]:
    """Every feed's tokens into ``b``, each at its position and sequence id, logits asked for where needed (all of
    a feed's with ``all_logits``, else its last token's if it ``ends``); the batch indices whose logits each feed
    gets."""
    n = 0
    wanted: list[list[int]] = []
    for f in feeds:
        idx = []
        for j, token in enumerate(f.tokens):
            b.token[n] = token
            b.pos[n] = f.start + j
            b.n_seq_id[n] = 1
            b.seq_id[n][0] = f.seq
            need = f.all_logits or (f.ends and j == len(f.tokens) - 1)
            b.logits[n] = 1 if need else 0
            if need:
                idx.append(n)
            n += 1
        wanted.append(idx)
    b.n_tokens = n
    return wanted


def read_logits(lib: Any, ctx: Any, row_type: Any, n_vocab: int, feeds: list[Feed],
                wanted: list[list[int]]) -> list[torch.Tensor]:
    """Each feed's logits rows after a decode. A driven feed's row is a view of llama.cpp's logits buffer, valid
    until the next decode: only `pick_driven` reads it (measured: the copy took a third of the decode thread's time
    between two decodes); the others are copied out as float32 rows."""
    out = []
    for f, idx in zip(feeds, wanted):
        if f.drive is not None:  # read by `pick_driven` before the next decode, then dropped: no copy
            row = row_type.from_address(ctypes.addressof(lib.llama_get_logits_ith(ctx, idx[0]).contents))
            out.append(torch.from_numpy(np.frombuffer(memoryview(row), dtype=np.float32))[None])
            continue
        rows = np.empty((len(idx), n_vocab), dtype=np.float32)
        for r, i in enumerate(idx):
            ptr = lib.llama_get_logits_ith(ctx, i)
            ctypes.memmove(rows[r].ctypes.data, ptr, n_vocab * 4)
        out.append(torch.from_numpy(rows))
    return out
