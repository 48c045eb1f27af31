"""Multiple-choice scoring: how a prompt and its choices become tokens, and what a choice's score is.

An engine scores *continuations*: ``score_continuations(prefix, continuations)`` gives, for each
continuation, the logprob of each of its tokens after the prefix and the tokens before it. A plain
local model reads the prefix once: prefix and continuations packed into one forward with a tree-shaped
attention mask (`engines.transformers.batching`); any other engine scores ``prefix + continuation`` once per choice
(`by_prompt_logprobs`), which is exact too.

Splitting follows lm-evaluation-harness, so that the same item gives the same numbers there and
here: a text prompt's trailing whitespace moves to the front of every choice, the prefix is the
prompt's own encoding and a choice's tokens are what encoding ``prompt + choice`` adds after it.
A chat prompt (messages) ends with the template's assistant header, so a choice is encoded alone.

Four normalisations, each a softmax over the choices of one score per choice:

* ``sum``: the summed logprob (lm-eval's ``acc``);
* ``mean``: the summed logprob over the number of tokens;
* ``char``: the summed logprob over the choice's length in characters (lm-eval's ``acc_norm``);
* ``unconditional``: the summed logprob minus the choice's summed logprob after a neutral prefix (the
  tokenizer's BOS, or its end-of-text token): pointwise mutual information with the prompt.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass

from chorus.engines.core.base import Engine, Tokenizer
from chorus.engines.core.request_scope import RequestScope
from chorus.errors import ContextLengthExceeded, InvalidRequest

NORMALISATIONS = ("sum", "mean", "char", "unconditional")


@dataclass
class Split:
    """A prompt and its choices as tokens: one prefix shared by every choice."""

    prefix: list[int]
    choices: list[list[int]]


def split_text(tok: Tokenizer, prompt: str, choices: Sequence[str]) -> Split:
    """lm-eval's split of ``prompt + choice`` (whitespace moved into the choice)."""
    stripped = prompt.rstrip()
    space = prompt[len(stripped):]
    prefix = tok.encode(stripped) if stripped else neutral_prefix(tok)
    out = []
    for c in choices:
        whole = tok.encode(stripped + space + c) if stripped else prefix + tok.encode_text(space + c)
        out.append(whole[len(prefix):])
    return Split(prefix, out)


def split_chat(tok: Tokenizer, messages: list[dict], choices: Sequence[str]) -> Split:
    """Messages through the chat template (ending with the assistant header); each choice encoded alone."""
    return Split(tok.encode_chat(messages), [tok.encode_text(c) for c in choices])


def neutral_prefix(tok: Tokenizer) -> list[int]:
    """What a choice is scored after for the ``unconditional`` normalisation: the tokens the tokenizer
    puts before any text (a BOS), or else its (lowest-numbered) end-of-text token."""
    return tok.encode("") or [min(tok.eos_token_ids)]


async def by_prompt_logprobs(engine: Engine, prefix: list[int], continuations: list[list[int]],
                             scope: RequestScope | None = None) -> list[list[float]]:
    """The generic way: ``prefix + continuation`` scored whole, once per continuation (concurrently)."""
    scored = await asyncio.gather(*(engine.prompt_logprobs(prefix + c, 0, scope) for c in continuations))
    return [[float(t.logprob) for t in lps[len(prefix):] if t is not None] for lps in scored]


def normalised(logprobs: Sequence[float], tokens: Sequence[int], chars: Sequence[int],
               unconditional: Sequence[float] | None) -> dict[str, list[float]]:
    """Each normalisation's score per choice (before the softmax)."""
    out = {
        "sum": list(logprobs),
        "mean": [lp / max(n, 1) for lp, n in zip(logprobs, tokens)],
        "char": [lp / max(n, 1) for lp, n in zip(logprobs, chars)],
    }
    if unconditional is not None:
        out["unconditional"] = [lp - u for lp, u in zip(logprobs, unconditional)]
    return out


def softmax(scores: Sequence[float]) -> list[float]:
    top = max(scores)
    exps = [math.exp(s - top) for s in scores]
    total = sum(exps)
    return [e / total for e in exps]


def argmax(values: Sequence[float]) -> int:
    """The first index of the largest value (ties go to the earlier choice, as numpy's argmax)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def mixture_logprob(member_logprobs: Sequence[Sequence[float]], weights: Sequence[float]) -> list[float]:
    """Per token, the logprob of a probability-space mixture: ``log sum_i w_i exp(lp_i)`` (one vocabulary)."""
    out = []
    for per_member in zip(*member_logprobs):
        terms = [math.log(w) + lp for w, lp in zip(weights, per_member) if w > 0]
        top = max(terms)
        out.append(top + math.log(sum(math.exp(t - top) for t in terms)))
    return out


@dataclass
class ChoiceScores:
    """One model's scores of a prompt's choices (or a token-level ensemble's, which scores like one model)."""

    texts: list[str]
    per_token: list[list[float]]  #: each choice token's logprob after the prompt and the tokens before it
    unconditional: list[float] | None  #: each choice's summed logprob after the neutral prefix
    prefix_tokens: int
    neutral_tokens: int = 0

    @property
    def logprobs(self) -> list[float]:
        return [math.fsum(t) for t in self.per_token]

    @property
    def tokens(self) -> list[int]:
        return [len(t) for t in self.per_token]

    @property
    def tokens_scored(self) -> int:
        """Tokens this scoring read (usage): the prefix, every choice, and again for ``unconditional``."""
        total = self.prefix_tokens + sum(self.tokens)
        if self.unconditional is not None:
            total += self.neutral_tokens + sum(self.tokens)
        return total

    def probabilities(self, normalisations: Sequence[str]) -> dict[str, list[float]]:
        scores = normalised(self.logprobs, self.tokens, [len(t) for t in self.texts], self.unconditional)
        return {n: softmax(scores[n]) for n in normalisations}


async def score_choices(engine: Engine, choices: Sequence[str], *, text: str | None = None,
                        messages: list[dict] | None = None, unconditional: bool = True,
                        scope: RequestScope | None = None) -> ChoiceScores:
    """Score ``choices`` after a text prompt or chat messages; 400s for a choice with no tokens or one that
    does not fit the context window with the prompt."""
    tok = engine.tokenizer
    split = split_chat(tok, messages, choices) if messages is not None else split_text(tok, text or "", choices)
    for i, c in enumerate(split.choices):
        if not c:
            raise InvalidRequest(f"choices[{i}] has no tokens (an empty choice cannot be scored).", param="choices")
        if len(split.prefix) + len(c) > engine.max_model_len:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {engine.max_model_len} tokens; the prompt ({len(split.prefix)}"
                f" tokens) with choices[{i}] ({len(c)} tokens) does not fit.", param="choices")
    per_token = await engine.score_continuations(split.prefix, split.choices, scope)
    if not unconditional:
        return ChoiceScores(list(choices), per_token, None, len(split.prefix))
    neutral = neutral_prefix(tok)
    unc = [math.fsum(t) for t in await engine.score_continuations(neutral, split.choices, scope)]
    return ChoiceScores(list(choices), per_token, unc, len(split.prefix), len(neutral))
