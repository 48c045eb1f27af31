"""The KV cache the batching engine and the model families share: layers that append in place.

transformers' `DynamicLayer` concatenates on every update, copying the whole cache each decode step;
a `GrowingLayer` keeps its keys / values as views into buffers with spare room, so an append is a
write and a buffer doubles when full. MoDr's per-step slots are `GrowingLayer`s too.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer


class GrowingLayer(DynamicLayer):
    """A cache layer whose keys / values are views into buffers with spare room.

    `DynamicLayer` concatenates on every update, copying the whole cache each decode step; here an
    append writes in place and the buffer doubles when full.
    """

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
        self.keys, self.values = self._k[:, :, :t], self._v[:, :, :t]
        self.device, self.dtype, self.is_initialized = keys.device, keys.dtype, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self._adopt(key_states, value_states, room=64)
            return self.keys, self.values
        t = self._t + key_states.shape[-2]
        if t > self._k.shape[2]:
            self._adopt(self.keys, self.values, room=max(64, t))
        self._k[:, :, self._t : t] = key_states
        self._v[:, :, self._t : t] = value_states
        self._t = t
        self.keys, self.values = self._k[:, :, :t], self._v[:, :, :t]
        return self.keys, self.values

    def overwrite_tail(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Replace the last columns written (a slot shared by several recurrence steps of one forward)."""
        n = key_states.shape[-2]
        self._k[:, :, self._t - n : self._t] = key_states
        self._v[:, :, self._t - n : self._t] = value_states
        return self.keys, self.values


class GrowingCache(DynamicCache):
    """A `DynamicCache` made of `GrowingLayer`s (full attention on every layer; chorus builds the masks)."""

    def __init__(self, layers: list[GrowingLayer] | None = None) -> None:
        if layers is None:
            Cache.__init__(self, layer_class_to_replicate=GrowingLayer)
        else:
            Cache.__init__(self, layers=layers)


def cache_from(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> GrowingCache:
    """A cache holding copies of the given (keys, values) per layer, each in a buffer with room to grow."""
    return GrowingCache([GrowingLayer(k, v) for k, v in layers])
