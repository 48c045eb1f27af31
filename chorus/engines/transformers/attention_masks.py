"""4-D boolean attention masks built from real positions, so padding never shifts a row's positions; Gemma-style
sliding-window layers get their own mask, computed on real positions too."""

from __future__ import annotations

from typing import Any

import torch


class AttentionMasks:
    """The masks one model's forwards take (a dict per layer type where the model mixes full and sliding
    attention)."""

    def __init__(self, model_config: Any) -> None:
        cfg = model_config.get_text_config()
        self.sliding_window: int | None = getattr(cfg, "sliding_window", None)
        layer_types: list[str] | None = getattr(cfg, "layer_types", None)
        self.uses_sliding = bool(layer_types and "sliding_attention" in layer_types and self.sliding_window)

    def build(self, q_pos: torch.Tensor, kv_pos: torch.Tensor, kv_valid: torch.Tensor | None = None,
              allowed: torch.Tensor | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
        """A query at position q sees real keys at positions <= q (and > q - window on sliding layers).
        q_pos: (B, Lq); kv_pos, kv_valid: (B, Lk); ``allowed`` (B, Lq, Lk): which keys a query may see at all
        (multiple-choice scoring's tree)."""
        causal = kv_pos[:, None, :] <= q_pos[:, :, None]  # (B, Lq, Lk)
        allowed = causal if allowed is None else causal & allowed
        if kv_valid is not None:
            allowed = allowed & kv_valid[:, None, :]
        if not self.uses_sliding:
            return allowed[:, None]
        assert self.sliding_window is not None  # uses_sliding
        near = kv_pos[:, None, :] > q_pos[:, :, None] - self.sliding_window
        return {"full_attention": allowed[:, None], "sliding_attention": (allowed & near)[:, None]}
