"""The wire format of chorus's session API (server/api/extensions/sessions.py): next-token distributions in JSON.

Full logits travel as base64 little-endian float32 (exact, ~4 bytes per vocabulary entry: 196 KB a
step for a 49k vocabulary); top-k as ids with their logprobs. The worker encodes, the gateway's
remote engine decodes.
"""

from __future__ import annotations

import base64
from typing import Any

import torch


def next_token(logits: torch.Tensor, top_k: int | None) -> dict[str, Any]:
    if top_k is None:
        data = logits.detach().to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
        return {"encoding": "base64-f32le", "size": int(logits.numel()), "logits": base64.b64encode(data).decode()}
    lp = torch.log_softmax(logits.float(), -1)
    vals, ids = torch.topk(lp, min(top_k, lp.numel()))
    return {"ids": ids.tolist(), "logprobs": vals.tolist()}


def decode_next(data: dict[str, Any], vocab_size: int) -> torch.Tensor:
    """The gateway's side: ``next`` back into a vocabulary-sized tensor (-inf outside a top-k)."""
    if "logits" in data:
        out = torch.frombuffer(bytearray(base64.b64decode(data["logits"])), dtype=torch.float32)
        if out.numel() != vocab_size:
            raise ValueError(f"the worker sent {out.numel()} logits for a vocabulary of {vocab_size}")
        return out
    out = torch.full((vocab_size,), float("-inf"))
    out[torch.tensor(data["ids"], dtype=torch.long)] = torch.tensor(data["logprobs"], dtype=torch.float32)
    return out
