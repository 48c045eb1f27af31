"""The transformers engine's prefix cache books (engines/transformers/prefix_store.py): what a prompt reuses, that
an extension replaces its prefix, the byte budget and least-recently-used eviction, salts, and which model families
take part. The forwards themselves run on SmolLM2 (tests/integration/test_transformers_prefix_cache.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from chorus.engines.families.modr.serving import RoutingObserver
from chorus.engines.families.moe import ExpertLoad
from chorus.engines.families.reasonformer.serving import ReasonObserver
from chorus.engines.runtime.observer import DenseObserver
from chorus.engines.transformers.prefix_store import PrefixStore, copy_layers

A = list(range(100))
B = [*range(50), *range(500, 550)]
PER_TOKEN = 2 * 2 * 2 * 4 * 4  # 2 layers x (keys, values) x 2 heads x 4 dims x 4 bytes


def kv(tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two layers of keys / values whose every column holds its token id (so a copy can be checked)."""
    col = torch.tensor(tokens, dtype=torch.float32)[None, None, :, None].expand(1, 2, len(tokens), 4)
    return copy_layers([(col, -col), (col + 1, col - 1)], len(tokens))


def test_a_prompt_reuses_the_longest_common_prefix_but_its_last_token() -> None:
    store = PrefixStore(1 << 20, min_tokens=10)
    assert store.lookup(A) == (None, 0) and store.misses == 1
    assert store.wants(A)
    entry = store.store(A, None, kv(A))
    assert entry is not None and entry.nbytes == 100 * PER_TOKEN == store.held_bytes
    hit, n = store.lookup(B)
    assert hit is entry and n == 50
    assert torch.equal(hit.layers[0][0][0, 0, :n, 0], torch.arange(50.0))  # the columns of the shared tokens
    assert store.lookup(A) == (entry, 99)  # the last token is computed: its logits are what prefill returns
    assert store.hits == 2 and store.hit_tokens == 149


def test_short_or_covered_prompts_are_not_stored_and_an_extension_replaces_its_prefix() -> None:
    store = PrefixStore(1 << 20, min_tokens=10)
    assert not store.wants(A[:9])
    store.store(A[:60], None, kv(A[:60]))
    assert not store.wants(A[:40])  # a prefix of an entry's tokens
    store.store(A, None, kv(A))
    assert [e.tokens for e in store.entries] == [A] and store.held_tokens == 100


def test_the_budget_holds_by_evicting_the_least_recently_used() -> None:
    store = PrefixStore(250 * PER_TOKEN, min_tokens=10)
    a = store.store(A, None, kv(A))
    store.store(B, None, kv(B))
    store.lookup(A)  # A used after B
    c = [7] * 100
    store.store(c, None, kv(c))
    assert [e.tokens for e in store.entries] == [A, c] and a is not None and store.evictions == 1
    assert store.held_bytes <= store.budget_bytes
    big = list(range(1000, 1300))
    assert store.store(big, None, kv(big)) is None and store.held_tokens == 200  # bigger than the budget: run uncached
    assert store.clear() == 200 and store.entries == []


def test_a_salt_keeps_prefixes_apart_and_a_zero_budget_is_off() -> None:
    store = PrefixStore(1 << 20, min_tokens=10)
    store.store(A, "tenant-a", kv(A))
    assert store.lookup(A) == (None, 0) and store.lookup(A, "tenant-b") == (None, 0)
    assert store.lookup(A, "tenant-a")[1] == 99
    assert store.wants(A, "tenant-b")
    off = PrefixStore(0)
    assert not off.enabled and not off.wants(A) and off.store(A, None, kv(A)) is None
    assert off.lookup(A) == (None, 0) and off.misses == 0


def test_families_whose_cache_is_not_per_token_keys_and_values_do_not_reuse_prefixes() -> None:
    assert DenseObserver.reuses_prefixes and ExpertLoad.reuses_prefixes
    assert not RoutingObserver.reuses_prefixes and not ReasonObserver.reuses_prefixes


def test_a_step_takes_cold_prompts_together_and_each_hits_rest_beside_them() -> None:
    import asyncio
    from collections import deque

    from chorus.engines.transformers.batch_rows import PrefillJob
    from chorus.engines.transformers.prefill_plan import plan_prefills, split_plan

    loop = asyncio.new_event_loop()
    try:
        def job(n: int, cached: int = 0) -> PrefillJob:
            j = PrefillJob([SimpleNamespace(closed=False)], list(range(n)), loop.create_future())
            if cached:
                j.seed, j.done = ([], cached), cached
            return j

        cold_a, hit, cold_b, late = job(40), job(300, cached=290), job(50), job(400)
        plan = plan_prefills(deque([cold_a, hit, cold_b, late]), rows=0, budget=128, max_batch_size=8)
        assert [(j, n) for j, n in plan] == [(cold_a, 40), (hit, 10), (cold_b, 50)]  # 10 + 2 x 50 <= 128
        alone, together = split_plan(plan)
        assert alone == [(hit, 10)] and together == [cold_a, cold_b]
        long = job(500)
        assert plan_prefills(deque([long, cold_a]), 0, 128, 8) == [(long, 128)]  # a chunk of a long prompt: alone
    finally:
        loop.close()
