"""Structured outputs: a request's output format as a token mask on every decoding step, with llguidance.

A `Constraint` (engines/core/base.py) is what the client asked for (a JSON schema, any JSON object, a regular
expression, one of a list of strings, a Lark / GBNF grammar), engine-neutral: remote engines send it on
as vLLM's ``structured_outputs`` object; here it becomes an llguidance grammar. A `Guide` is one decoding
row's matcher over one tokenizer: before each token it masks the logits to the tokens the grammar allows
(EOS only where the output may end), after it consumes the sampled token. Rows without a constraint have
no guide and pay nothing.

llguidance, not xgrammar (README "Structured outputs (`chorus bench structured`)"): both masks cost a few
tenths of a millisecond per token on either default vocabulary, invisible next to a decode step (xgrammar
measured about 1.8x cheaper per token in the committed run); llguidance has no dependencies (xgrammar pulls
in triton, ~1 GB) and its Lark grammars embed JSON schemas, which the forced native tool call uses.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch

from chorus.engines.core.base import Constraint, Tokenizer
from chorus.errors import EngineFailed, InvalidRequest

if TYPE_CHECKING:
    from llguidance import LLTokenizer

#: llguidance's JSON options: one space after ':' and ',' (as ``json.dumps``), no other whitespace
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@functools.lru_cache(maxsize=256)
def grammar(c: Constraint) -> str:
    """The llguidance grammar of a constraint, built once per constraint (the request's check, then every row
    of every member reuse it); a malformed schema, pattern or grammar is a 400 naming its ``param``."""
    import llguidance

    try:
        if c.kind in ("json", "json_object"):
            # compact separators, no free whitespace: small models given free whitespace may emit
            # newlines until max_tokens instead of closing the object
            return llguidance.LLMatcher.grammar_from_json_schema(bounded(c.schema), defaults=JSON_OPTIONS)
        fmt = {"regex": "regex", "choice": "choice", "grammar": "grammar"}[c.kind]
        return llguidance.grammar_from(fmt, c.spec)  # type: ignore[arg-type]
    except (ValueError, KeyError) as exc:
        raise InvalidRequest(f"{c.param}: invalid {c.kind}: {exc}", param=c.param) from None


#: I-JSON's interoperable integers (RFC 7493 section 2.2): the range doubles hold exactly
SAFE_INTEGER = 2**53 - 1


def bounded(schema: Any) -> Any:
    """The schema with every unbounded ``integer`` / ``number`` held to I-JSON's range: the answer still
    validates against the client's schema, and a small model can no longer write digits until max_tokens
    (SmolLM2 at temperature 0 wrote 240 zeros after ``{"population": 1``)."""
    if isinstance(schema, list):
        return [bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded(v) if isinstance(v, (dict, list)) and k not in ("enum", "const", "default", "examples")
           else v for k, v in schema.items()}
    kinds = out.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "integer" in kinds or "number" in kinds:
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -SAFE_INTEGER
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INTEGER
    return out


def check(c: Constraint) -> None:
    """Compile a constraint's grammar once without a tokenizer: errors are the client's (400), before any work."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar(c))
    if error and not error.startswith("WARNING"):
        raise InvalidRequest(f"{c.param}: the {c.kind} cannot be used as a constraint: {error}", param=c.param)


_tokenizers: weakref.WeakKeyDictionary[Any, LLTokenizer] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def ll_tokenizer(tok: Tokenizer) -> LLTokenizer:
    """llguidance's view of a tokenizer, built once per tokenizer (0.7-7 s: every token's bytes)."""
    with _lock:
        cached = _tokenizers.get(tok)
        if cached is None:
            cached = _build(tok)
            _tokenizers[tok] = cached
        return cached


def _build(tok: Tokenizer) -> LLTokenizer:
    import llguidance

    eos = sorted(tok.eos_token_ids)
    hf = getattr(tok, "hf", None)
    if hf is not None and hasattr(hf, "backend_tokenizer"):
        import llguidance.hf

        return llguidance.hf.from_tokenizer(hf, n_vocab=tok.vocab_size, eos_token=eos)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrapped(tok)), eos_token=eos)


class _Wrapped:
    """Any chorus tokenizer as llguidance's ``TokenizerWrapper`` expects it: token bytes (special tokens
    marked with a leading 0xff byte, llguidance's convention) and an encode function."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        strings = tok.token_strings()
        self.special_token_ids = [i for i, s in enumerate(strings) if not s]
        self.tokens = [s.encode() if s else b"\xff<special_%d>" % i for i, s in enumerate(strings)]
        self.eos_token_id = min(tok.eos_token_ids)
        self.bos_token_id = None

    def __call__(self, s: str | bytes) -> list[int]:
        return self._tok.encode_text(s.decode("utf-8", "replace") if isinstance(s, bytes) else s)


class Guide:
    """One row's matcher: `mask` the logits before sampling, `accept` the sampled token after."""

    def __init__(self, constraint: Constraint, tok: Tokenizer) -> None:
        import llguidance
        import llguidance.torch

        self.constraint = constraint
        self._ll = llguidance.torch
        lltok = ll_tokenizer(tok)
        self.matcher = llguidance.LLMatcher(lltok, grammar(constraint))
        if self.matcher.is_error():
            raise InvalidRequest(f"{constraint.param}: {self.matcher.get_error()}", param=constraint.param)
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of the logits with every token the grammar forbids here at -inf."""
        self._ll.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        out = logits.float().clone()
        self._ll.apply_token_bitmask_inplace(out, self._bitmask)
        if not torch.isfinite(out).any():
            raise EngineFailed(f"the {self.constraint.kind} constraint left no token the model offers (a remote "
                               "member's top logprobs hold none of the allowed tokens)")
        return out

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise EngineFailed(f"constrained decoding: token {token} was not allowed: {self.matcher.get_error()}")

    def allows(self, ids: list[int]) -> bool:
        """Whether the grammar accepts these tokens next (without consuming them)."""
        return self.matcher.validate_tokens(ids) == len(ids)

    def accept_all(self, ids: list[int]) -> None:
        if not self.matcher.consume_tokens(ids):
            raise EngineFailed(f"constrained decoding: tokens {ids} were not allowed: {self.matcher.get_error()}")

    @property
    def accepting(self) -> bool:
        """The output so far is complete (the grammar may end here)."""
        return bool(self.matcher.is_accepting())

    @property
    def stopped(self) -> bool:
        """Nothing may follow: the output is complete and ends here."""
        return bool(self.matcher.is_stopped())
