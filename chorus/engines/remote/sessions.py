"""A remote model's token-level sessions (logit averaging over workers): `RemoteSession` approximates the next-token
distribution with top-k logprobs over ``/v1/completions`` (any OpenAI server), `WorkerSession` holds an exact one on
a chorus worker's session API. Both ask their engine (engine.py's `RemoteEngine`, as an `Upstream`) for the wire."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

import aiohttp
import torch

from chorus.engines.core.base import check_rollback
from chorus.engines.core.request_scope import UNSCOPED, RequestScope
from chorus.engines.remote.replicas import Replica, ReplicaPool, Retryable
from chorus.engines.remote.routing import Ask, ask_of
from chorus.engines.remote.session_wire import decode_next
from chorus.errors import EngineFailed, InvalidRequest


class Upstream(Protocol):
    """What a session asks of its engine."""

    name: str
    upstream_model: str
    tokenizer: Any
    pool: ReplicaPool
    sessions: set[WorkerSession]  #: the open worker sessions

    async def next_token_logprobs(self, ids: list[int], scope: RequestScope) -> torch.Tensor: ...

    def salted(self, body: dict[str, Any], scope: RequestScope) -> dict[str, Any]: ...

    async def post_any(self, url_of: Callable[[Replica], str], body: dict[str, Any],
                       ask: Ask | None = None) -> tuple[Replica, dict[str, Any]]: ...

    async def call(self, replica: Replica, method: str, url: str, body: dict[str, Any] | None = None) -> dict[str, Any]: ...

    def close_later(self, replica: Replica, sid: str) -> None: ...


class RemoteSession:
    """A token-level session over ``/v1/completions``: every step asks for one token with the top-k
    logprobs of the prompt so far (token ids). The server's prefix cache plays the KV cache; the logits
    hold the top-k tokens' logprobs and -inf elsewhere (an approximation of the full distribution)."""

    def __init__(self, engine: Upstream, scope: RequestScope | None = None) -> None:
        self.engine = engine
        self.scope = scope or UNSCOPED
        self.ids: list[int] = []

    @property
    def length(self) -> int:
        return len(self.ids)

    async def prefill(self, ids: Any) -> torch.Tensor:
        self.ids = list(ids)
        return await self.engine.next_token_logprobs(self.ids, self.scope)

    async def step(self, token: int) -> torch.Tensor:
        self.ids.append(int(token))
        return await self.engine.next_token_logprobs(self.ids, self.scope)

    async def extend(self, ids: Any) -> torch.Tensor:
        """Each new prefix asked at once (the server batches them; its prefix cache shares the work)."""
        start = len(self.ids)
        self.ids.extend(int(t) for t in ids)
        rows = await asyncio.gather(*(self.engine.next_token_logprobs(self.ids[: start + j + 1], self.scope)
                                      for j in range(len(self.ids) - start)))
        return torch.stack(rows)

    def rollback(self, n: int) -> None:
        check_rollback(n, len(self.ids))
        del self.ids[len(self.ids) - n :]

    def close(self) -> None:
        self.ids = []


def sessions_url(replica: Replica) -> str:
    """A chorus worker's session API (version 2) sits at its root, beside ``/v1``."""
    return replica.url.removesuffix("/v1") + "/chorus/v2/sessions"


class WorkerSession:
    """An exact token-level session on a chorus worker (``/chorus/v2/sessions``, server/api/extensions/sessions.py).

    The prefill picks a replica (retrying others while they fail) and the session stays on it: its KV
    cache lives there, so a failure after the prefill ends the session (``EngineFailed``). A step, an
    ``extend`` (several tokens, one request, one forward there) and a ``rollback`` (sent with the next
    step) map onto the v2 step. ``close()`` sends the DELETE in the background; a session the gateway
    never closes is freed by the worker's idle timeout."""

    def __init__(self, engine: Upstream, scope: RequestScope | None = None) -> None:
        self.engine = engine
        self.scope = scope or UNSCOPED
        self.replica: Replica | None = None
        self.id: str | None = None
        self.length = 0
        self.dropping = 0  # rolled back here, sent with the next step

    async def prefill(self, ids: Any) -> torch.Tensor:
        engine = self.engine
        body = engine.salted({"model": engine.upstream_model, "prompt": list(ids)}, self.scope)
        replica, data = await engine.post_any(sessions_url, body, ask_of(body["prompt"], self.scope))
        self.replica, self.id, self.length = replica, data["id"], len(body["prompt"])
        replica.outstanding += 1  # an open session is work held on that replica
        engine.sessions.add(self)
        return decode_next(data["next"], engine.tokenizer.vocab_size)

    async def step(self, token: int) -> torch.Tensor:
        return (await self.extend([token]))[-1]

    async def extend(self, ids: Any) -> torch.Tensor:
        if self.replica is None or self.id is None:
            raise InvalidRequest("prefill the session before stepping it")
        tokens = [int(t) for t in ids]
        body: dict[str, Any] = {"tokens": tokens}
        if self.dropping:
            body["rollback"] = self.dropping
        try:
            data = await self.engine.call(self.replica, "POST", f"{sessions_url(self.replica)}/{self.id}/step", body)
        except (aiohttp.ClientError, TimeoutError, Retryable) as exc:
            self.engine.pool.failed(self.replica, f"{type(exc).__name__}: {exc}")
            raise EngineFailed(f"{self.engine.name}: the worker holding the session failed: {exc}") from exc
        self.dropping = 0
        self.length += len(tokens)
        vocab = self.engine.tokenizer.vocab_size
        return torch.stack([decode_next(d, vocab) for d in data["next"]])

    def rollback(self, n: int) -> None:
        check_rollback(n, self.length)
        self.length -= n
        self.dropping += n

    def close(self) -> None:
        if self.replica is None or self.id is None:
            return
        replica, sid, self.replica, self.id = self.replica, self.id, None, None
        replica.outstanding -= 1
        self.engine.sessions.discard(self)
        self.engine.close_later(replica, sid)
