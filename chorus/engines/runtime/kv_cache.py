"""The KV cache the batching engine and the model families share: layers that append in place.

transformers' `DynamicLayer` concatenates on every update, copying the whole cache each decode step;
a `GrowingLayer` keeps its keys / values as views into buffers with spare room, so an append is a
write and a buffer doubles when full. MoDr's per-step slots are `GrowingLayer`s too.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer


class GrowingLayer(DynamicLayer):
    """A cache layer whose keys / values are views into buffers with spare room.

    `DynamicLayer` concatenates on every update, copying the whole cache each decode step; here an
    append writes in place and the buffer doubles when full.
    """

    keys: torch.Tensor  # (B, H, T, D) views into the buffers, once initialized
    values: torch.Tensor

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None) -> None:
        super().__init__()
        if keys is not None and values is not None:
            self._adopt(keys, values, room=64)

    def _adopt(self, keys: torch.Tensor, values: torch.Tensor, room: int) -> None:
        b, h, t, d = keys.shape  # (B, H, T, D)
        self._k = keys.new_empty(b, h, t + room, d)
        self._v = values.new_empty(b, h, t + room, values.shape[-1])
        self._k[:, :, :t] = keys
        self._v[:, :, :t] = values
        self._t = t
        self._view()
        self.device, self.dtype, self.is_initialized = keys.device, keys.dtype, True

    def _view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The filled part of the buffers, as ``keys`` / ``values`` (views: no copy)."""
        k, v = self._k[:, :, : self._t], self._v[:, :, : self._t]
        self.keys, self.values = k, v
        return k, v

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self._adopt(key_states, value_states, room=64)
            return self._view()
        t = self._t + key_states.shape[-2]
        if t > self._k.shape[2]:
            self._adopt(*self._view(), room=max(64, t))
        self._k[:, :, self._t : t] = key_states
        self._v[:, :, self._t : t] = value_states
        self._t = t
        return self._view()

    def crop(self, t: int) -> None:
        """Keep the first ``t`` columns (the rest were rolled back; the buffer keeps its room)."""
        self._t = min(self._t, t)
        self._view()

    def overwrite_tail(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Replace the last columns written (a slot shared by several recurrence steps of one forward)."""
        n = key_states.shape[-2]
        self._k[:, :, self._t - n : self._t] = key_states
        self._v[:, :, self._t - n : self._t] = value_states
        return self._view()


class GrowingCache(DynamicCache):
    """A `DynamicCache` made of `GrowingLayer`s (full attention on every layer; chorus builds the masks)."""

    def __init__(self, layers: list[GrowingLayer] | None = None) -> None:
        if layers is None:
            Cache.__init__(self, layer_class_to_replicate=GrowingLayer)
        else:
            Cache.__init__(self, layers=cast(list[Any], layers))

    @property
    def growing(self) -> list[GrowingLayer]:
        """The layers, typed as what they are (transformers types them as any cache layer)."""
        return cast(list[GrowingLayer], self.layers)


def cache_from(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> GrowingCache:
    """A cache holding copies of the given (keys, values) per layer, each in a buffer with room to grow."""
    return GrowingCache([GrowingLayer(k, v) for k, v in layers])


class StepSlots:
    """A cache with one slot per (layer, step) for a model that runs a block of layers several times
    (MoDr's recurrent core, ReasonFormer's reasoning steps): the layers' view of it. Maps a layer call to
    a slot, appends once per forward, then overwrites.

    Slot layout: the fixed layers (prelude / representation, then coda), then the ``n_core`` repeated
    layers of step 0, step 1, ... New step slots on a cache that already holds tokens start as a copy
    of the latest step ("latest" lookup).
    """

    def __init__(self, cache: Any, n_pre: int, n_coda: int, n_core: int) -> None:
        self.cache = cache
        self.n_pre, self.n_coda, self.n_core = n_pre, n_coda, n_core
        self.written: set[int] = set()
        self.peek = False

    def core_slot(self, step_slot: int, i: int) -> int:
        return self.n_pre + self.n_coda + step_slot * self.n_core + i

    def steps_held(self) -> int:
        return step_slots(self.cache.layers, self.n_pre + self.n_coda, self.n_core)

    def ensure_steps(self, n: int) -> None:
        layers = self.cache.layers
        while len(layers) < self.n_pre + self.n_coda:
            layers.append(GrowingLayer())
        grow_steps(layers, self.n_pre + self.n_coda, self.n_core, n)

    def update(
        self, k: torch.Tensor, v: torch.Tensor, idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.cache.layers[idx]
        if self.peek:  # exit probe through the coda: read the cache, write nothing
            if not layer.is_initialized:
                return k, v
            return torch.cat([layer.keys, k], -2), torch.cat([layer.values, v], -2)
        if idx in self.written:
            return layer.overwrite_tail(k, v)
        self.written.add(idx)
        return layer.update(k, v)

    def pad_unwritten(self, last_written: int, n_new: int) -> None:
        """Step slots this forward did not reach (no row ran that step): append the ``last_written`` step's
        new columns, so every cache layer keeps the same length."""
        for step in range(self.steps_held()):
            for i in range(self.n_core):
                idx = self.core_slot(step, i)
                if idx not in self.written:
                    src = self.cache.layers[self.core_slot(last_written, i)]
                    self.cache.layers[idx].update(src.keys[:, :, -n_new:].clone(), src.values[:, :, -n_new:].clone())
                    self.written.add(idx)

    def copy_tail(self, dst: int, src: int, rows: torch.Tensor, n: int) -> None:
        d, s = self.cache.layers[dst], self.cache.layers[src]
        d.keys[rows, :, -n:] = s.keys[rows, :, -n:]
        d.values[rows, :, -n:] = s.values[rows, :, -n:]


def step_slots(layers: list[Any], fixed: int, core: int) -> int:
    """Step slots held by a `StepSlots` cache: the ``fixed`` layers first, then ``core`` per step."""
    return max(0, (len(layers) - fixed) // core)


def grow_steps(layers: list[Any], fixed: int, core: int, steps: int) -> list[Any]:
    """Append step slots up to ``steps``; a new slot starts as a copy of the latest step's K/V (Huginn's
    "latest" lookup for tokens that never ran it), or empty when there is none yet."""
    for step in range(step_slots(layers, fixed, core), steps):
        for i in range(core):
            src = layers[fixed + (step - 1) * core + i] if step > 0 else None
            layers.append(GrowingLayer(src.keys, src.values) if src is not None and src.is_initialized
                          else GrowingLayer())
    return layers


def run_layers(layers: Any, x: torch.Tensor, slots: list[int] | None, cache: StepSlots | None,
               mask: torch.Tensor | None, pos: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Run transformers decoder layers in turn, layer i reading and writing cache slot ``slots[i]``."""
    layer: Any  # a transformers decoder layer
    for i, layer in enumerate(layers):
        if slots is not None:
            layer.self_attn.layer_idx = slots[i]
        x = layer(x, attention_mask=mask, position_ids=pos, cache=cache, position_embeddings=rope)
    return x
