"""What a request carries to the engines beside its parameters: which request it is (sessions it holds open are
grouped), the tenant's prefix-cache scope and the request's ``cache_salt``, the routing key of a conversation, and
whether it is batch work. Set by the gateway (server/gateway/admission.py, server/resolve.py,
api/extensions/sessions.py) for everything the request runs; read by the engines' prefix caches, schedulers and
the remote engine's routing.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import deque
from collections.abc import Callable
from typing import TypeVar

#: the request the running code works for: the gateway sets a new one for each HTTP request, and the tasks a
#: request starts inherit it. An engine whose sequences are scarce (llama.cpp's) gives the sessions one request
#: holds open their sequences together (`request_scope`).
REQUEST_SCOPE: contextvars.ContextVar[object | None] = contextvars.ContextVar("chorus_request", default=None)
#: the request's ``cache_salt`` (vLLM's field): an engine's prefix cache shares prefixes only under one salt; set by
#: the route for everything the request runs (its sessions, an ensemble's members)
CACHE_SALT: contextvars.ContextVar[str | None] = contextvars.ContextVar("chorus_cache_salt", default=None)
#: the tenant the request runs for, as the prefix caches see it (an opaque token, server/gateway/tenancy.py): set by the
#: gateway from the caller's key before any route runs, so no client field can widen it; None: unscoped
CACHE_SCOPE: contextvars.ContextVar[str | None] = contextvars.ContextVar("chorus_cache_scope", default=None)
#: a conversation key (the request's ``user``): a remote model's ``session`` routing keeps one key on one replica;
#: set by the route for everything the request runs
AFFINITY: contextvars.ContextVar[str | None] = contextvars.ContextVar("chorus_affinity", default=None)


#: the request is batch work (a Batch API line, server/batch/runner.py): set by the gateway's front door for the
#: runner's own calls; an engine's scheduler queues its prompts behind every live one (`queue_in`)
BACKGROUND: contextvars.ContextVar[bool] = contextvars.ContextVar("chorus_background", default=False)

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


def prefix_salt() -> str | None:
    """What an engine's prefix cache stores a prefix under and looks it up by: the tenant scope (`CACHE_SCOPE`)
    narrowed by the request's ``cache_salt``. Two requests share a prefix only when both are equal; None (no
    keys, no salt) is today's shared cache of a one-user server. A remote engine sends it on as ``cache_salt``."""
    scope, salt = CACHE_SCOPE.get(), CACHE_SALT.get()
    if scope is None:
        return salt
    return scope if salt is None else f"{scope}:{salt}"


def request_scope() -> object | None:
    """The current request (`REQUEST_SCOPE`), or outside one the current task."""
    return REQUEST_SCOPE.get() or asyncio.current_task()
