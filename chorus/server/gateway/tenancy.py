"""Tenants apart in the prefix caches: the scope a request's cached prefixes live under.

An engine's prefix cache answers a prompt that starts like an earlier one from the stored cells, and the caller
sees it (``usage.prompt_tokens_details.cached_tokens``, a first token in a fraction of the cold time). Shared
between keys, that lets one key test, token by token, what another key's prompt starts with. So the gateway gives
every request a tenant before any route runs (``Context.tenant``, handed to the engines in the request's
`RequestScope`, whose ``prefix_salt`` the prefix caches store under):

- ``server.prefix_cache.share: key`` (the default): the key's own scope; ``team``: the key's team's (a key with no
  ``team`` keeps its own); ``all``: no scope (every caller shares, as a one-user server does).
- No keys configured (local, unauthenticated use): no scope, today's shared cache.
- The client's ``cache_salt`` only narrows within the scope (engines store under scope + salt): no body field or
  header can reach another scope.

A scope is an opaque token: an HMAC of the key's (or team's) name under a secret made from every configured key's
SHA-256, so gateway replicas with the same keys agree (a worker's cache serves a tenant from any of them), and a
caller who reaches a worker directly cannot forge one: the worker combines whatever ``cache_salt`` it is sent with
its own caller's scope, and only the gateway's key has the gateway's.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from typing import Literal

from chorus.server.gateway.auth import Principal

Share = Literal["key", "team", "all"]


def scope_secret(key_hashes: Iterable[str]) -> bytes:
    """The HMAC secret of the scopes: every key's SHA-256, in a stable order (the same on every replica)."""
    return hashlib.sha256("\n".join(sorted(key_hashes)).encode()).digest()


def cache_scope(principal: Principal | None, share: Share, secret: bytes) -> str | None:
    """The prefix-cache scope of a request by ``principal`` (None: unscoped, shared with every unscoped one)."""
    if principal is None or share == "all":
        return None
    who = f"team:{principal.team}" if share == "team" and principal.team else f"key:{principal.name}"
    return hmac.new(secret, who.encode(), hashlib.sha256).hexdigest()[:32]
