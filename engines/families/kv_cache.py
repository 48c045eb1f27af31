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
