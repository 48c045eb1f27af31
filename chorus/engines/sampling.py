"""Turn next-token logits into a token: penalties, temperature, top-k, top-p, seeded draws, logprobs."""

from __future__ import annotations

import os

import torch

from chorus.engines.base import SamplingParams


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator; the same seed gives the same draws."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1))
    return gen


def apply_penalties(logits: torch.Tensor, counts: dict[int, int], params: SamplingParams) -> torch.Tensor:
    """OpenAI presence / frequency penalties over the tokens generated so far."""
    if not counts or (params.presence_penalty == 0.0 and params.frequency_penalty == 0.0):
        return logits
    ids = torch.tensor(list(counts.keys()), dtype=torch.long)
    n = torch.tensor(list(counts.values()), dtype=logits.dtype)
    out = logits.clone()
    out[ids] -= params.frequency_penalty * n + params.presence_penalty
    return out


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus); removed entries become -inf. logits: (V,)."""
    x = logits / params.temperature
    if params.top_k and 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(sorted_x, dim=-1) >= params.top_p  # keep the token that crosses top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, order, sorted_x)
    return x


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
           counts: dict[int, int] | None = None) -> int:
    logits = apply_penalties(logits.float(), counts or {}, params)
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(filter_logits(logits, params), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_from_probs(probs: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Sample from a probability vector (used by strategies that combine distributions)."""
    return sample(torch.log(probs.clamp_min(1e-30)), params, generator)


def logprob_info(logits: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """Log-probability of ``token`` under the model's distribution and its top ``k`` alternatives."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top: list[tuple[int, float]] = []
    if k > 0:
        vals, ids = torch.topk(lp, k)
        top = [(int(i), float(v)) for i, v in zip(ids, vals)]
    return float(lp[token]), top
