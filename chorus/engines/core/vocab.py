"""A tokenizer's vocabulary as strings: each token id's text, and text -> token id.

Used where tokens travel as text: the top-k union across vocabularies (ensembles/logit_average/topk_union.py) and a
remote server's top logprobs, which name tokens by their text (engines/remote/engine.py).
"""

from __future__ import annotations

from functools import cache

from chorus.engines.core.base import Tokenizer


class Vocab:
    """A member tokenizer's token strings, and string -> token id (built once per tokenizer: ~2 s for 262k)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.strings = tok.token_strings()
        self.ids: dict[str, int] = {}
        repeated: set[str] = set()
        for i, s in enumerate(self.strings):
            if s and i not in tok.eos_token_ids:
                if s in self.ids:
                    repeated.add(s)
                self.ids.setdefault(s, i)
        for s in repeated:  # e.g. Gemma's byte-fallback <0x3F> and "?": the tokenizer's own choice wins
            own = tok.encode_text(s)
            if len(own) == 1:
                self.ids[s] = own[0]
        self.eos = sorted(tok.eos_token_ids)

    def first_id(self, s: str) -> int | None:
        if s in self.ids:
            return self.ids[s]
        ids = self.tok.encode_text(s)
        return ids[0] if ids else None

    def pieces(self, s: str) -> list[int]:
        return [self.ids[s]] if s in self.ids else self.tok.encode_text(s)


@cache
def vocab_of(tok: Tokenizer) -> Vocab:
    return Vocab(tok)
