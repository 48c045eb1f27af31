"""The transformers engine's prefix cache: finished prompts' keys and values kept in memory, within a byte budget,
and a new prompt started from the longest cached prefix of it.

When a prompt's prefill finishes, its cache (per layer, keys and values of shape (1, H, T, D)) is copied into an
entry keyed by its exact token ids and its request's ``cache_salt``. A new prompt takes the entry of the same salt
with the longest common prefix, if at least ``min_tokens`` long and at most all its tokens but the last (the last
token's logits are what prefill returns): its first columns seed the prefill's cache and only the rest of the
prompt is computed, as a chunk that starts past the prefix (chunked prefill's own path, so positions and masks are
the ones a cold prefill uses). Entries are read, never written: a hit copies the columns it uses.

Books: an entry whose tokens a new prompt extends is replaced by it (a chat growing turn by turn keeps one entry);
a prompt already covered by an entry is not stored twice; past the budget, the least recently used entries are
evicted; a prompt bigger than the whole budget is simply not stored. Each entry holds its own copy of its
prefix: prompts that share a system prompt but differ after it hold that system prompt once each (no radix tree),
so a budget of B bytes keeps about B / (prompt KV bytes) of them. Only the first token ids are compared, so the
cost of a lookup is linear in the entries' lengths (microseconds next to a forward).

Runs on the event-loop thread (lookups, books) and the forward thread (copies); the books are touched only on the
event loop.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from chorus.engines.core.prefix_books import PrefixCounters, common_prefix

Layers = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Entry:
    tokens: list[int]
    salt: str | None
    layers: Layers  # per layer, (keys, values) of the tokens: (1, H, T, D), compact
    nbytes: int
    used: int = 0  # a tick of the store's clock when last stored or hit


def copy_layers(layers: Layers, n: int) -> Layers:
    """The first ``n`` columns of each layer, in compact tensors of their own."""
    return [(k[:, :, :n].clone(), v[:, :, :n].clone()) for k, v in layers]


class PrefixStore(PrefixCounters):
    def __init__(self, budget_bytes: int, min_tokens: int = 32) -> None:
        super().__init__()
        self.budget_bytes = budget_bytes
        self.min_tokens = min_tokens
        self.entries: list[Entry] = []
        self._clock = itertools.count(1)

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    @property
    def held_tokens(self) -> int:
        return sum(len(e.tokens) for e in self.entries)

    @property
    def held_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def lookup(self, ids: list[int], salt: str | None = None) -> tuple[Entry | None, int]:
        """The entry of the same ``salt`` with the longest common prefix of ``ids`` and how many of its tokens to
        reuse (at most all but the last of ``ids``); (None, 0) below ``min_tokens``. A hit is counted and the entry
        marked used."""
        if not self.enabled:
            return None, 0
        best, n = self.longest(self.entries, ids, salt, self.min_tokens)
        if best is not None:
            best.used = next(self._clock)
        return best, n

    def wants(self, tokens: list[int], salt: str | None = None) -> bool:
        """Whether ``tokens`` are worth a copy: long enough, not already held by an entry of the same salt (that
        entry is marked used)."""
        if not self.enabled or len(tokens) < self.min_tokens:
            return False
        for e in self.entries:
            if e.salt == salt and common_prefix(e.tokens, tokens) == len(tokens):
                e.used = next(self._clock)
                return False
        return True

    def store(self, tokens: list[int], salt: str | None, layers: Layers) -> Entry | None:
        """Keep ``layers`` (a copy the caller made, `copy_layers`) for ``tokens``: entries it extends are replaced,
        then the least recently used evicted until it fits. None when it exceeds the whole budget."""
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)
        if not self.enabled or nbytes > self.budget_bytes:
            return None
        self.entries = [e for e in self.entries
                        if not (e.salt == salt and common_prefix(e.tokens, tokens) == len(e.tokens))]
        while self.entries and self.held_bytes + nbytes > self.budget_bytes:
            self.entries.remove(min(self.entries, key=lambda e: e.used))
            self.evictions += 1
        entry = Entry(list(tokens), salt, layers, nbytes, next(self._clock))
        self.entries.append(entry)
        return entry

    def clear(self) -> int:
        """Forget every entry; the tokens they held."""
        held = self.held_tokens
        self.entries = []
        return held
