"""API keys and per-key limits.

Keys are kept only as SHA-256 hashes (from the config, or hashed at start-up from ``CHORUS_API_KEYS``);
a presented key is hashed and compared with every stored hash in constant time. Each key may be
limited to a set of models / ensembles (403 otherwise), to requests and tokens per minute (429 with
``Retry-After``) and to a number of requests in flight (429).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from chorus.config import ApiKey
from chorus.errors import AuthenticationFailed, ConfigError, PermissionDenied, RateLimited

WINDOW_S = 60.0


def hash_key(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


@dataclass
class Principal:
    """An authenticated key, with its sliding one-minute windows and in-flight count."""

    name: str
    sha256: str
    models: frozenset[str] | None = None
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    team: str | None = None  #: keys of one team may share prefix caches (``server.prefix_cache.share: team``)
    inline_ensembles: bool = True  #: may compose ensembles in a request body (over the models it may use)
    requests: deque[float] = field(default_factory=deque)
    tokens: deque[tuple[float, int]] = field(default_factory=deque)
    tokens_in_window: int = 0  # the sum over `tokens`, kept as they come and go (O(1) per request)
    inflight: int = 0

    def _expire(self, now: float) -> None:
        while self.requests and now - self.requests[0] >= WINDOW_S:
            self.requests.popleft()
        while self.tokens and now - self.tokens[0][0] >= WINDOW_S:
            self.tokens_in_window -= self.tokens.popleft()[1]

    def admit(self, now: float | None = None) -> None:
        """Count one request in, or raise `RateLimited` saying when to retry."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        if self.max_concurrent is not None and self.inflight >= self.max_concurrent:
            raise RateLimited(f"Key {self.name!r} has {self.inflight} requests in flight; its limit is "
                              f"{self.max_concurrent}.", retry_after=1.0)
        if self.rpm is not None and len(self.requests) >= self.rpm:
            raise RateLimited(f"Key {self.name!r} is limited to {self.rpm} requests per minute.",
                              retry_after=WINDOW_S - (now - self.requests[0]))
        used = self.tokens_in_window
        if self.tpm is not None and used >= self.tpm:
            raise RateLimited(f"Key {self.name!r} is limited to {self.tpm} tokens per minute ({used} used).",
                              retry_after=WINDOW_S - (now - self.tokens[0][0]))
        if self.rpm is not None:  # windows are kept only for the limits a key has
            self.requests.append(now)
        self.inflight += 1

    def release(self) -> None:
        self.inflight = max(0, self.inflight - 1)

    def charge(self, tokens: int) -> None:
        if tokens > 0 and self.tpm is not None:
            self.tokens.append((time.monotonic(), tokens))
            self.tokens_in_window += tokens

    def authorize(self, names: Iterable[str]) -> None:
        if self.models is None:
            return
        denied = sorted(set(names) - self.models)
        if denied:
            raise PermissionDenied(f"Key {self.name!r} may not use {', '.join(denied)}; it may use: "
                                   f"{', '.join(sorted(self.models))}.", param="model")


    def authorize_inline(self, names: Iterable[str]) -> None:
        """An ensemble composed in the request body: the key needs leave to compose (``inline_ensembles``) and
        every model the ensemble calls must be one it may use."""
        if not self.inline_ensembles:
            raise PermissionDenied(f"Key {self.name!r} may not compose ensembles in a request body "
                                   "(inline_ensembles: false); name a model or a named ensemble it may use.",
                                   param="ensemble")
        self.authorize(names)


class KeyStore:
    def __init__(self, keys: list[ApiKey], env_keys: str | None = None) -> None:
        self.principals = [Principal(k.name, k.sha256, frozenset(k.models) if k.models is not None else None,
                                     k.rpm, k.tpm, k.max_concurrent, k.team, k.inline_ensembles) for k in keys]
        for i, item in enumerate(x.strip() for x in (env_keys or "").split(",")):
            if item:
                name, _, raw = item.partition(":") if ":" in item else (f"env-{i + 1}", "", item)
                if any(p.name == name for p in self.principals):  # it would own the other key's files, unlimited
                    raise ConfigError(f"CHORUS_API_KEYS names a key {name!r}, a name already taken (by the config's "
                                      "auth.keys or earlier in CHORUS_API_KEYS): key names must be unique.")
                self.principals.append(Principal(name, hash_key(raw)))

    @property
    def enabled(self) -> bool:
        return bool(self.principals)

    def named(self, name: str) -> Principal:
        """The key called ``name`` (a batch runs as the key that created it)."""
        for p in self.principals:
            if p.name == name:
                return p
        raise AuthenticationFailed(f"The key {name!r} that created this batch is no longer configured.")

    def authenticate(self, authorization: str | None) -> Principal:
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthenticationFailed("Missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>').")
        presented = hash_key(token.strip())
        found = None
        for p in self.principals:  # every hash compared, in constant time: no early exit to time
            if hmac.compare_digest(p.sha256, presented):
                found = p
        if found is None:
            raise AuthenticationFailed("Incorrect API key provided.")
        return found
