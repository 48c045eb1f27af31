"""The batch's state between forwards: its rows (one open sequence each), one batched KV cache and the mask of
real tokens, and the surgery on them that runs on the event-loop thread, never during a forward: a finished
prefill joins (caches left-padded to one length and concatenated along the batch axis), closed rows leave
(columns that are padding for every remaining row trimmed), rolled-back tokens are masked out and trimmed, and
a batch made wide by rollback holes is compacted."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from chorus.engines.runtime.kv_cache import GrowingCache, cache_from
from chorus.engines.runtime.observer import FamilyObserver
from chorus.engines.transformers.prefix_store import Layers

#: the fewest hole columns (rolled back in one row, still used by another) worth a compaction
COMPACT_MIN = 8


class Row(Protocol):
    """What the batch keeps of a sequence (`batching.BatchedSession`)."""

    length: int
    joined: bool
    closed: bool
    dropping: int
    future: asyncio.Future[torch.Tensor] | None


@dataclass
class PrefillJob:
    """A prompt being prefilled for ``sessions`` (``n`` choices share one prefill), chunk by chunk."""

    sessions: list[Any]
    ids: list[int]
    future: asyncio.Future[torch.Tensor]
    done: int = 0
    cache: GrowingCache = field(default_factory=GrowingCache)
    logits: torch.Tensor | None = None
    #: a prefix cache hit: the entry's layers and how many of their columns seed this prefill (``done`` starts there)
    seed: tuple[Layers, int] | None = None
    keep: bool = False  # the prefix cache wants a copy of the prompt's keys and values when done
    kept: Layers | None = None  # that copy, made on the forward thread
    salt: str | None = None  # the request's cache_salt: stored and looked up under it
    background: bool = False  # batch work: queued behind every live prompt

    @property
    def cancelled(self) -> bool:
        return self.future.done() or all(s.closed for s in self.sessions)


class BatchRows:
    def __init__(self, device: torch.device, observer: FamilyObserver) -> None:
        self.device = device
        self.observer = observer
        self.rows: list[Any] = []
        self.cache: GrowingCache | None = None
        self.mask: torch.Tensor | None = None  # (B, T) 1 = real token

    def join(self, job: PrefillJob) -> None:
        n = len(job.sessions)
        new_t = job.cache.get_seq_length()
        new_mask = torch.ones(n, new_t, dtype=torch.long, device=self.device)
        new_layers = [(l.keys.expand(n, -1, -1, -1), l.values.expand(n, -1, -1, -1)) for l in job.cache.growing]
        if self.cache is None or self.mask is None or not self.rows:
            self.cache = cache_from([(k.contiguous(), v.contiguous()) for k, v in new_layers])
            self.mask = new_mask
        else:
            old_t = self.mask.shape[1]
            t = max(old_t, new_t)
            merged = []
            old_layers = list(self.cache.growing)
            if len(old_layers) != len(new_layers):  # MoDr: different numbers of recurrence-step slots
                old_layers, grown = self.observer.match_caches(old_layers, list(job.cache.growing))
                new_layers = [(l.keys.expand(n, -1, -1, -1), l.values.expand(n, -1, -1, -1)) for l in grown]
            for layer, (kn, vn) in zip(old_layers, new_layers):
                merged.append((torch.cat([lpad(layer.keys, t - old_t), lpad(kn, t - new_t)], 0),
                               torch.cat([lpad(layer.values, t - old_t), lpad(vn, t - new_t)], 0)))
            self.cache = cache_from(merged)
            self.mask = torch.cat([lpad(self.mask, t - old_t), lpad(new_mask, t - new_t)], 0)
        for s in job.sessions:
            s.length = new_t
            s.joined = True
        self.rows.extend(job.sessions)
        self.observer.joined(job.sessions)

    def drop_closed(self) -> None:
        keep = [i for i, s in enumerate(self.rows) if not s.closed]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not keep or self.cache is None or self.mask is None:
            self.rows, self.cache, self.mask = [], None, None
            return
        idx = torch.tensor(keep, device=self.device)
        mask = self.mask.index_select(0, idx)
        first = int((mask.sum(0) > 0).nonzero()[0])  # leading columns that are padding for every row
        self.mask = mask[:, first:]
        self.cache = cache_from(
            [
                (l.keys.index_select(0, idx)[:, :, first:], l.values.index_select(0, idx)[:, :, first:])
                for l in self.cache.growing
            ]
        )

    @torch.inference_mode()  # the mask and cache are inference tensors: edited in place only in this mode
    def apply_rollbacks(self) -> None:
        """Mask out the columns of rolled-back tokens (each row's last real ones), then trim the columns at
        the end that no row uses any more (at batch size 1: the cache is exactly the session's tokens)."""
        rolled = [(r, s.dropping) for r, s in enumerate(self.rows) if s.dropping]
        if not rolled or self.mask is None or self.cache is None:
            return
        for r, n in rolled:
            real = self.mask[r].nonzero()[:, 0]
            self.mask[r, real[len(real) - n :]] = 0
            self.rows[r].dropping = 0
        used = (self.mask.sum(0) > 0).nonzero()
        end = int(used[-1]) + 1 if len(used) else 0
        if end < self.mask.shape[1]:
            self.mask = self.mask[:, :end]
            for layer in self.cache.growing:
                layer.crop(end)
        self.compact()

    def compact(self) -> None:
        """When rolled-back holes make the batch much wider than its longest row, pack each row's real
        columns to the right of a cache that wide (one copy of the cache; rare: rollbacks are short)."""
        if self.mask is None or self.cache is None:
            return
        lens = self.mask.sum(1)
        b, t, width = self.mask.shape[0], self.mask.shape[1], int(lens.max())
        if t - width < max(COMPACT_MIN, t // 4):
            return
        idx = torch.zeros(b, width, dtype=torch.long, device=self.device)
        mask = torch.zeros(b, width, dtype=self.mask.dtype, device=self.device)
        for r in range(b):
            real = self.mask[r].nonzero()[:, 0]
            idx[r, width - len(real) :] = real
            mask[r, width - len(real) :] = 1
        layers = []
        for layer in self.cache.growing:
            k, v = layer.keys, layer.values
            gk = idx[:, None, :, None].expand(b, k.shape[1], width, k.shape[3])
            gv = idx[:, None, :, None].expand(b, v.shape[1], width, v.shape[3])
            layers.append((k.gather(2, gk), v.gather(2, gv)))
        self.cache, self.mask = cache_from(layers), mask

    def reset(self, err: Exception) -> None:
        """Every row ends with ``err`` (a failed forward, a shutdown) and the batch is empty."""
        for s in self.rows:
            resolve(s.future, err)
            s.closed = True
        self.rows, self.cache, self.mask = [], None, None


def resolve(fut: asyncio.Future[torch.Tensor] | None, value: torch.Tensor | BaseException) -> None:
    if fut is None or fut.done():
        return
    if isinstance(value, BaseException):
        fut.set_exception(value)
    else:
        fut.set_result(value)


def lpad(x: torch.Tensor, n: int) -> torch.Tensor:
    """Left-pad the sequence axis (-2 for (B, H, T, D) caches, -1 for (B, T) masks) with n zeros."""
    if n == 0:
        return x
    if x.dim() == 2:
        return torch.cat([x.new_zeros(x.shape[0], n), x], 1)
    b, h, _, d = x.shape
    return torch.cat([x.new_zeros(b, h, n, d), x], 2)
