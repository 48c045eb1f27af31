"""What a request carries to the engines beside its parameters, said out loud: a `RequestScope`, handed to every
engine call the request makes (``GenerationRequest.scope``, ``open_session(scope)``, ``prompt_logprobs(..., scope)``,
``score_continuations(..., scope)``). The gateway builds it once per request (server/resolve.py: the key's
prefix-cache tenant from the front door, the body's ``cache_salt`` and ``user``, batch priority, the deadline, the
request id); an ensemble's `Call` hands the same scope to each member call; the Batch API's runner and the session
API go through the same front door and resolve. Engines read it where it decides something: the prefix caches
(`prefix_salt`), the schedulers' queues (`background`, `queue_in`), llama.cpp's sequence ids (`owner`), the remote
engine's replica routing (`affinity`) and its batch priority.

A call without a scope (a benchmark, a test, a tool) is unscoped: no tenant, no salt, live work, its sessions
grouped by the task that opened them.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar


@dataclass(frozen=True)
class RequestScope:
    """One request's scope (frozen: an ensemble's members and a request's sessions share it as it is)."""

    #: the tenant the request runs for, as the prefix caches see it (an opaque token, server/gateway/tenancy.py),
    #: from the caller's key, so no client field can widen it; None: unscoped
    tenant: str | None = None
    #: the request's ``cache_salt`` (vLLM's field): a prefix cache shares prefixes only under one salt
    salt: str | None = None
    #: a conversation key (the request's ``user``): a remote model's ``session`` routing keeps one key on one replica
    affinity: str | None = None
    #: batch work (a Batch API line, or a body with ``priority`` > 0): queued behind every live prompt
    background: bool = False
    #: loop time after which the gateway cancels the request's work (None: no deadline)
    deadline: float | None = None
    #: the request's id (the trace's and the access log's)
    request_id: str = ""
    #: what groups the sessions one request holds open (llama.cpp gives them their sequences together): one object
    #: per request; None: the task that opens a session
    group: object | None = None

    @property
    def prefix_salt(self) -> str | None:
        """What an engine's prefix cache stores a prefix under and looks it up by: the tenant narrowed by the
        request's ``cache_salt``. Two requests share a prefix only when both are equal; None (no keys, no salt) is
        the shared cache of a one-user server. A remote engine sends it on as ``cache_salt``."""
        if self.tenant is None:
            return self.salt
        return self.tenant if self.salt is None else f"{self.tenant}:{self.salt}"

    def owner(self) -> object | None:
        """The request a session belongs to (`group`), or outside one the current task."""
        return self.group if self.group is not None else asyncio.current_task()


#: an unscoped call's scope
UNSCOPED = RequestScope()

_T = TypeVar("_T")


def queue_in(queue: deque[_T], item: _T, background: bool, is_background: Callable[[_T], bool]) -> None:
    """Put a prompt in an engine's prefill queue: background work at the end, live work ahead of the first
    background work waiting (first come, first served within each)."""
    if not background:
        for i, queued in enumerate(queue):
            if is_background(queued):
                queue.insert(i, item)
                return
    queue.append(item)
