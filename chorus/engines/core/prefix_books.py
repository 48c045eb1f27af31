"""What both engines' prefix caches share: the longest common prefix of two token lists, the counters every cache
keeps, and how they are shown (Prometheus families and `/health` stats, under the same names on both engines)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from chorus.engines.runtime.metric import Metric


class Held(Protocol):
    """A cached prefix: its token ids and the salt it was stored under."""

    tokens: list[int]
    salt: str | None


H = TypeVar("H", bound=Held)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class PrefixCounters:
    """Since start-up: lookups that hit and missed, prompt tokens served from the cache, prefixes evicted."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    hit_tokens: int = 0

    def hit(self, tokens: int) -> None:
        self.hits += 1
        self.hit_tokens += tokens

    def longest(self, held: Iterable[H], ids: list[int], salt: str | None, min_tokens: int) -> tuple[H | None, int]:
        """Of ``held``, the prefix of the same ``salt`` with the longest common prefix of ``ids`` and how many of
        its tokens to reuse (at most all but the last of ``ids``: its logits are what prefill returns); (None, 0)
        below ``min_tokens``. Counts the hit or the miss."""
        best, n = None, 0
        if len(ids) > min_tokens:
            for h in held:
                c = min(common_prefix(h.tokens, ids), len(ids) - 1) if h.salt == salt else 0
                if c > n:
                    best, n = h, c
        if best is None or n < min_tokens:
            self.misses += 1
            return None, 0
        self.hit(n)
        return best, n

    def metrics(self, held_tokens: int, held_bytes: int) -> list[Metric]:
        return [
            ("chorus_prefix_cache_lookups_total", "prefix cache lookups by new prompts", ["result"],
             [(["hit"], float(self.hits)), (["miss"], float(self.misses))]),
            ("chorus_prefix_cache_hit_tokens_total", "prompt tokens read from the prefix cache", [],
             [([], float(self.hit_tokens))]),
            ("chorus_prefix_cache_evictions_total", "cached prefixes evicted (least recently used)", [],
             [([], float(self.evictions))]),
            ("chorus_prefix_cache_tokens", "tokens held in the prefix cache", [], [([], float(held_tokens))]),
            ("chorus_prefix_cache_bytes", "KV bytes held in the prefix cache", [], [([], float(held_bytes))]),
        ]

    def stats(self, held_tokens: int) -> dict[str, int]:
        return {"prefix_cache_hits": self.hits, "prefix_cache_misses": self.misses,
                "prefix_cache_evictions": self.evictions, "prefix_cache_tokens": held_tokens}
