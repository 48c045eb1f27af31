"""The llama.cpp engine's prefix cache: finished sequences' KV cells kept in spare sequences of the context, and a
new sequence started from the longest cached prefix of its prompt.

The context holds ``max_batch_size`` sequences that decode and ``slots`` more that only keep cells (with the cache
split per sequence, each is a KV stream of ``max_model_len`` cells of its own). When a prefilled session closes,
the tokens its cells hold (its prompt and what it read through ``extend``; a driven choice's sampled tokens are
not recorded) go into a slot: the slot whose tokens they extend, else a free one, else the least recently used,
which is evicted. Tokens already covered by a slot (a prefix of its tokens) are not stored twice. A new prompt
takes the slot with the longest common prefix, if that is at least ``min_tokens`` long, and at most all its tokens
but the last (the last token's logits are what prefill returns): the slot's cells are copied into the new
sequence and only the rest of the prompt is decoded.

The copies are llama.cpp's ``llama_memory_seq_cp`` between streams, which copies the whole stream's buffer at
the next decode (no compute; about the KV bytes of ``max_model_len`` tokens), followed by ``llama_memory_seq_rm``
of the cells past the prefix. Keys are exact token ids, so a hit is the same prefix; its logits equal a cold
prefill's up to how llama.cpp's kernels round for a batch of another shape (tests/integration measure it).
This class only keeps the books (which slot holds which tokens, hits, evictions); the runner does the copies on
its decode thread.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from chorus.engines.core.prefix_books import PrefixCounters, common_prefix

__all__ = ["PrefixCache", "Slot", "common_prefix"]


@dataclass
class Slot:
    seq: int
    tokens: list[int] = field(default_factory=list)
    salt: str | None = None  # the cache_salt of the request that stored it: only the same salt reuses it
    used: int = 0  # a tick of the cache's clock when last stored or hit (least recently used is evicted)


class PrefixCache(PrefixCounters):
    def __init__(self, seqs: range | list[int], min_tokens: int = 32) -> None:
        super().__init__()
        self.slots = [Slot(s) for s in seqs]
        self.min_tokens = min_tokens
        self._clock = itertools.count(1)
        self.bytes_per_token = 0  # a cached token's KV bytes (measured by the runner at the first store)

    @property
    def enabled(self) -> bool:
        return bool(self.slots)

    @property
    def held_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.slots)

    def lookup(self, ids: list[int], salt: str | None = None) -> tuple[Slot | None, int]:
        """The slot of the same ``salt`` with the longest common prefix of ``ids`` and how many of its tokens to
        reuse (at most all but the last of ``ids``); (None, 0) below ``min_tokens``. A hit is counted and the slot
        marked used."""
        if not self.slots:
            return None, 0
        best, n = self.longest(self.slots, ids, salt, self.min_tokens)
        if best is not None:
            best.used = next(self._clock)
        return best, n

    def place(self, tokens: list[int], salt: str | None = None) -> Slot | None:
        """The slot to store ``tokens`` (under ``salt``) in, its old tokens replaced, or None when they are not
        worth storing (shorter than ``min_tokens``) or already held (a prefix of a same-salt slot's tokens: that
        slot is marked used)."""
        if not self.slots or len(tokens) < self.min_tokens:
            return None
        for s in self.slots:
            if s.salt == salt and common_prefix(s.tokens, tokens) == len(tokens):
                s.used = next(self._clock)
                return None
        extended = [s for s in self.slots
                    if s.tokens and s.salt == salt and common_prefix(s.tokens, tokens) == len(s.tokens)]
        free = [s for s in self.slots if not s.tokens]
        if extended:
            slot = extended[0]
        elif free:
            slot = free[0]
        else:
            slot = min(self.slots, key=lambda s: s.used)
            self.evictions += 1
        slot.tokens = list(tokens)
        slot.salt = salt
        slot.used = next(self._clock)
        return slot

    def clear(self) -> list[int]:
        """Forget every slot; the sequences whose cells the runner must clear."""
        held = [s.seq for s in self.slots if s.tokens]
        for s in self.slots:
            s.tokens, s.salt = [], None
        return held
