"""Which replica answers a request: a registry of policies (``remote.routing``), each ordering the healthy replicas
it may use, best first (the pool then fails over along that order, as it always did).

- ``least_outstanding`` (the default): the replica with the fewest requests on it (ties: the one that served
  fewest), blind to what the replicas hold in their prefix caches. "On it" is the replica's `load`: this gateway's
  requests in flight there, or what the replica's own gauges report when that is more (replicas.py).
- ``prefix``: the replica most likely to hold the request's prefix in its cache. The prompt's token ids (the
  gateway renders them with the model's own tokenizer, so they are the ids the worker caches) are cut into blocks
  of ``block_tokens``, each block's hash chained to the previous one's and seeded with the request's prefix scope
  (its tenant and ``cache_salt``: two tenants never share a cache, so they never share a hash). The pool remembers,
  per replica, the block hashes of what it sent there (an LRU of ``index_blocks``; recorded when a request is sent,
  so one with the same prefix a moment later follows it); a request goes to the replica holding the longest run of
  its leading blocks, when that run is at least ``min_match_tokens`` (a chat template's fixed opening alone does
  not count). With no such run (a new conversation, a unique prompt) it goes to the least busy replica (``cold:
  least_outstanding``, the default), or (``cold: ring``) its opening is placed on a consistent-hash ring
  (``virtual_nodes`` points per replica), so the same opening lands on the same replica and different ones spread.
  Either way the load is bounded: a replica with more than ``load_factor`` times the mean requests in flight (plus
  one), and with at least ``spill_after``, is passed over for the next best, so a hot prefix spills to a second
  replica rather than queueing on one (bounded loads as in Mirrokni, Thorup and Zadimoghaddam's consistent hashing
  with bounded loads, 2018).
- ``session``: the same replica for the same conversation key (the request's ``user``, else its prefix scope)
  on the same bounded-load ring: sticky without reading prompts.

A conversation's growing history keeps its leading blocks, and an ensemble's rounds and samples repeat their
prompt, so ``prefix`` keeps each of them on the replica that holds it.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from chorus.engines.core.request_scope import UNSCOPED, RequestScope
from chorus.lazy import load

REPLICA_POLICIES: dict[str, str] = {
    "least_outstanding": "chorus.engines.remote.routing:LeastOutstanding",
    "prefix": "chorus.engines.remote.routing:PrefixAffinity",
    "session": "chorus.engines.remote.routing:SessionAffinity",
}


@dataclass
class Ask:
    """What a policy may read of one request (replicas are read as replicas.py's `Replica`: ``url``,
    ``load``, ``served``)."""

    prompt_ids: Sequence[int] = ()
    scope: str | None = None  #: the prefix scope sent as ``cache_salt`` (tenant, narrowed by the client's salt)
    session: str | None = None  #: a conversation key (the request's ``user``)
    #: the prompt's chained block hashes, once a policy has computed them (read when picking and when recorded)
    chain: list[int] | None = field(default=None, repr=False)


def ask_of(prompt_ids: Sequence[int], scope: RequestScope | None = None) -> Ask:
    """What the routing policy reads of a request: its prompt's ids, its prefix scope, its conversation key."""
    scope = scope or UNSCOPED
    return Ask(prompt_ids, scope.prefix_salt, scope.affinity)


class Policy:
    name = ""

    def __init__(self, urls: list[str], options: Any) -> None:
        self.options = options

    def order(self, candidates: list[Any], ask: Ask) -> list[Any]:
        """``candidates`` (healthy, not yet tried), best first."""
        raise NotImplementedError

    def sent(self, replica: Any, ask: Ask) -> None:
        """``ask`` went to ``replica`` (and was answered): what a policy that remembers learns."""

    def stats(self) -> dict[str, int]:
        return {}


def least_busy(candidates: list[Any]) -> list[Any]:
    return sorted(candidates, key=lambda r: (r.load, r.served))


class LeastOutstanding(Policy):
    name = "least_outstanding"

    def order(self, candidates: list[Any], ask: Ask) -> list[Any]:
        return least_busy(candidates)


def digest(*parts: bytes) -> int:
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(p)
        h.update(b"\x00")
    return int.from_bytes(h.digest(), "big")


class Ring:
    """A consistent-hash ring over the replicas' URLs (``points`` per replica)."""

    def __init__(self, urls: list[str], points: int) -> None:
        marks = sorted((digest(u.encode(), str(i).encode()), u) for u in urls for i in range(points))
        self.keys = [k for k, _ in marks]
        self.urls = [u for _, u in marks]

    def walk(self, key: int) -> list[str]:
        """Every URL once, in ring order from ``key``."""
        start = bisect.bisect(self.keys, key)
        seen: dict[str, None] = {}
        for i in range(len(self.urls)):
            seen.setdefault(self.urls[(start + i) % len(self.urls)], None)
        return list(seen)


def bounded(order: list[Any], candidates: list[Any], factor: float, floor: int) -> list[Any]:
    """``order`` with every replica over the load bound moved behind the others (in their order): the bound is
    ``factor`` times the mean of the candidates' requests in flight, counting this one, and never under ``floor``
    (a replica batches several sequences: two requests in flight on one are no reason to lose its cache)."""
    total = sum(r.load for r in candidates) + 1
    bound = max(math.ceil(factor * total / max(len(candidates), 1)), floor)
    return [r for r in order if r.load < bound] + [r for r in order if r.load >= bound]


class RingPolicy(Policy):
    def __init__(self, urls: list[str], options: Any) -> None:
        super().__init__(urls, options)
        self.ring = Ring(urls, options.virtual_nodes)

    def on_ring(self, candidates: list[Any], key: int) -> list[Any]:
        by_url = {r.url: r for r in candidates}
        return bounded([by_url[u] for u in self.ring.walk(key) if u in by_url], candidates, self.options.load_factor,
                       self.options.spill_after)


class SessionAffinity(RingPolicy):
    name = "session"

    def order(self, candidates: list[Any], ask: Ask) -> list[Any]:
        key = ask.session or ask.scope
        if key is None:
            return least_busy(candidates)
        return self.on_ring(candidates, digest(key.encode()))


class PrefixAffinity(RingPolicy):
    name = "prefix"

    def __init__(self, urls: list[str], options: Any) -> None:
        super().__init__(urls, options)
        self.held: dict[str, OrderedDict[int, None]] = {u: OrderedDict() for u in urls}
        self.matched = 0  #: requests sent where a replica held a run of their blocks
        self.placed = 0  #: requests placed on the ring (no run long enough)

    def blocks(self, ask: Ask) -> list[int]:
        """The chained hashes of the prompt's whole blocks (computed once per request)."""
        if ask.chain is None:
            size = self.options.block_tokens
            ids = array("q", ask.prompt_ids).tobytes()
            out, h = [], digest((ask.scope or "").encode())
            for i in range(0, len(ids) - size * 8 + 1, size * 8):
                h = digest(h.to_bytes(8, "big"), ids[i:i + size * 8])
                out.append(h)
            ask.chain = out
        return ask.chain

    def order(self, candidates: list[Any], ask: Ask) -> list[Any]:
        chain = self.blocks(ask)
        need = max(1, self.options.min_match_tokens // self.options.block_tokens)
        runs = {r.url: self.run(r.url, chain) for r in candidates}
        best = max(runs.values(), default=0)
        if best >= need:
            self.matched += 1
            ranked = sorted(candidates, key=lambda r: (-runs[r.url], r.load, r.served))
            return bounded(ranked, candidates, self.options.load_factor, self.options.spill_after)
        self.placed += 1
        if self.options.cold == "least_outstanding":
            return least_busy(candidates)
        if len(chain) >= need:
            return self.on_ring(candidates, chain[need - 1])
        head = digest((ask.scope or "").encode(), array("q", list(ask.prompt_ids)[:64]).tobytes())
        return self.on_ring(candidates, head)

    def run(self, url: str, chain: list[int]) -> int:
        held = self.held.get(url)
        n = 0
        while held is not None and n < len(chain) and chain[n] in held:
            n += 1
        return n

    def sent(self, replica: Any, ask: Ask) -> None:
        held = self.held.setdefault(replica.url, OrderedDict())
        for h in self.blocks(ask):
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.options.index_blocks:
            held.popitem(last=False)

    def stats(self) -> dict[str, int]:
        return {"routed_by_prefix": self.matched, "routed_by_ring": self.placed}


def policy(name: str, urls: list[str], options: Any) -> Policy:
    """The policy ``name`` of the registry over ``urls``."""
    found: type[Policy] = load(REPLICA_POLICIES[name])
    return found(urls, options)
