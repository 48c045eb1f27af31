"""The sampling half of the decode loop: a choice's next token from its logits, and whether it is the last.

`TokenPicker` holds one choice's sampling state (the generator, the token counts for the penalties, the
grammar matcher) and turns a logits row into a `Pick`: the token, its logprobs when asked for, and why the
choice ends there, if it does (EOS, a grammar that is complete, ``max_tokens``). It needs nothing of the event
loop, so an engine can run it on its own decode thread (the llama.cpp engine samples plain requests there,
right after each decode, instead of handing every token's logits to the event loop and waiting for it).

`stepped_picks` is the generic driver: pick, step the session with the token, pick again. Text (the
detokenizer, stop strings) is the other half, in `generation.decode_loop`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import torch

from chorus.engines.core.base import SamplingParams, Session, Tokenizer, TokenLogprob, TopLogprob
from chorus.engines.core.constraint import Guide
from chorus.engines.core.sampling import logprob_info, sample


@dataclass(frozen=True)
class Pick:
    """One sampled token. ``eos``: an end-of-sequence token that ends the choice (it is not text);
    ``final``: the finish reason when the choice ends with this token (``stop`` or ``length``), else None."""

    token: int
    logprobs: list[TokenLogprob]
    eos: bool = False
    final: str | None = None


def token_logprob(tokenizer: Tokenizer, logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    lp, top = logprob_info(logits, token, k)
    return TokenLogprob(
        token=tokenizer.decode([token]), token_id=token, logprob=lp,
        top=[TopLogprob(tokenizer.decode([i]), v) for i, v in top],
    )


def biases(params: SamplingParams, logits: torch.Tensor) -> torch.Tensor | None:
    """``logit_bias`` as a vector over the logits (None without one); ids were checked by `encode_prompt`."""
    if not params.logit_bias:
        return None
    bias = torch.zeros(logits.shape[-1])
    for token, value in params.logit_bias:
        bias[token] = value
    return bias


class TokenPicker:
    """One choice's sampler: ``logit_bias``, the grammar mask, penalties, temperature / top-k / top-p, seeds,
    logprobs (of the distribution the token is drawn from), and the end of the choice."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, generator: torch.Generator, max_tokens: int,
                 guide: Guide | None = None) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.generator = generator
        self.max_tokens = max_tokens
        self.guide = guide
        self.counts: dict[int, int] = {}
        self.produced = 0
        self._bias: torch.Tensor | None = None
        self._eos = frozenset() if params.ignore_eos and guide is None else frozenset(tokenizer.eos_token_ids)

    def __call__(self, logits: torch.Tensor) -> Pick:
        params = self.params
        if self._bias is None and params.logit_bias:
            self._bias = biases(params, logits)
        if self._bias is not None:
            logits = logits.float() + self._bias
        if self.guide is not None:
            logits = self.guide.mask(logits)
        token = sample(logits, params, self.generator, self.counts)
        self.counts[token] = self.counts.get(token, 0) + 1
        self.produced += 1
        lps = [token_logprob(self.tokenizer, logits, token, params.top_logprobs)] if params.logprobs else []
        if token in self._eos:
            return Pick(token, lps, eos=True, final="stop")
        if self.guide is not None:
            self.guide.accept(token)
            if self.guide.stopped:  # the grammar is complete: nothing may follow
                return Pick(token, lps, final="stop")
        return Pick(token, lps, final="length" if self.produced >= self.max_tokens else None)


async def stepped_picks(session: Session, logits: torch.Tensor, picker: TokenPicker) -> AsyncGenerator[Pick, None]:
    """Pick a token, step the session with it, until a pick is final (or the consumer stops asking)."""
    while True:
        # a grammar's first mask can take seconds (README, measured): off the event loop; later ones take
        # ~0.2 ms, inline, so the rows of a batch submit their next tokens within the same step
        first_mask = picker.guide is not None and picker.produced == 0
        pick = await asyncio.to_thread(picker, logits) if first_mask else picker(logits)
        yield pick
        if pick.final:
            return
        logits = await session.step(pick.token)
