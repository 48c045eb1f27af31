"""The prefix cache's books (engines/llama_cpp/prefix_cache.py): which slot holds which prefix, what a prompt reuses,
what is evicted, and that a cache_salt keeps prefixes apart. The copies themselves run on llama.cpp
(tests/integration/test_llama_prefix_cache.py)."""

from __future__ import annotations

import httpx
import pytest

from chorus.engines.fake.engine import FakeEngine
from chorus.engines.llama_cpp.prefix_cache import PrefixCache, common_prefix
from tests.helpers import LiveServer, serve_fakes

A = list(range(100))
B = [*range(50), *range(500, 550)]


def test_a_prompt_reuses_the_longest_common_prefix_but_its_last_token() -> None:
    cache = PrefixCache([8, 9], min_tokens=10)
    assert cache.lookup(A) == (None, 0) and cache.misses == 1
    slot = cache.place(A)
    assert slot is not None and slot.seq == 8 and slot.tokens == A
    hit, n = cache.lookup(B)
    assert hit is slot and n == 50 == common_prefix(A, B)
    hit, n = cache.lookup(A)
    assert hit is slot and n == 99  # the last token is computed: its logits are what prefill returns
    assert cache.hits == 2 and cache.hit_tokens == 149


def test_short_prefixes_are_neither_kept_nor_reused() -> None:
    cache = PrefixCache([8], min_tokens=10)
    assert cache.place(A[:9]) is None and cache.held_tokens == 0
    cache.place(A)
    assert cache.lookup([*A[:9], 999]) == (None, 0)  # 9 shared tokens: below min_tokens


def test_covered_tokens_are_not_stored_twice_and_an_extension_replaces_its_prefix() -> None:
    cache = PrefixCache([8, 9], min_tokens=10)
    first = cache.place(A[:60])
    assert cache.place(A[:40]) is None  # already held (a prefix of a slot's tokens)
    longer = cache.place(A)
    assert longer is first and first.tokens == A and cache.held_tokens == 100  # extended in place


def test_the_least_recently_used_slot_is_evicted() -> None:
    cache = PrefixCache([8, 9], min_tokens=10)
    a, b = cache.place(A), cache.place(B)
    assert a is not None and b is not None and a is not b
    cache.lookup(A)  # A used after B
    c = cache.place([7] * 40)
    assert c is b and cache.evictions == 1
    hit, n = cache.lookup(B)
    assert hit is a and n == 50  # B's own slot is gone: only what it shares with A is left
    assert cache.clear() == [8, 9] and cache.held_tokens == 0


def test_a_salt_keeps_prefixes_apart() -> None:
    cache = PrefixCache([8, 9], min_tokens=10)
    cache.place(A, "tenant-a")
    assert cache.lookup(A) == (None, 0)  # no salt: not tenant-a's prefix
    assert cache.lookup(A, "tenant-b") == (None, 0)
    assert cache.lookup(A, "tenant-a")[1] == 99
    assert cache.place(A[:50], "tenant-b") is not None  # covered only under tenant-a: stored again for tenant-b


@pytest.fixture(scope="module")
def server() -> LiveServer:
    with serve_fakes({"fake": FakeEngine("fake")}) as srv:
        yield srv


def test_cache_salt_is_checked_and_accepted(server: LiveServer) -> None:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    bad = httpx.post(server.url + "/v1/chat/completions", json={**body, "cache_salt": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"
    ok = httpx.post(server.url + "/v1/chat/completions", json={**body, "cache_salt": "tenant-a"})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    text = httpx.post(server.url + "/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 2,
                                                            "cache_salt": "tenant-a"})
    assert text.status_code == 200
