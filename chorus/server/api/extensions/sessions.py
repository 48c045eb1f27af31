"""Token-level sessions over HTTP (versions 1 and 2): what a gateway needs to run logit averaging on a worker.

A chorus worker exposes its engines' sessions so that a gateway elsewhere can average members token
by token with their exact next-token logits (``remote.token_api: chorus`` on the gateway side)::

    POST   /chorus/v1/sessions              {"model", "prompt": [ids], "top_k"?}  -> 200 session + next
    POST   /chorus/v1/sessions/{id}/step    {"token": id, "top_k"?}               -> 200 session + next
    DELETE /chorus/v1/sessions/{id}                                               -> 200 {"deleted": true}
    GET    /chorus/v1/sessions                                                    -> 200 {"open": n, ...}

``next`` holds the next-token distribution: without ``top_k`` the full logits as base64 little-endian
float32 (``{"encoding": "base64-f32le", "size": V, "logits": "..."}``), with ``top_k`` the k best
``{"ids": [...], "logprobs": [...]}``. Every response carries ``X-Chorus-Session-API: 2`` (the newest version
served). A session
is one KV cache in the engine's batch (it batches with everything else); it is closed by DELETE, or
freed once idle for ``server.sessions.idle_timeout_s``; at most ``server.sessions.max_open`` are open.
Errors use the OpenAI envelope: an unknown or expired session is 404 ``session_not_found``, a step
while the previous one is still running 409 ``session_busy``, too many sessions 429.

Version 2 (``/chorus/v2/sessions``, same open / list / delete) makes a step carry several tokens and a
rollback, for speculative and selective token ensembles::

    POST   /chorus/v2/sessions/{id}/step    {"rollback": n?, "tokens": [ids], "top_k"?}
        -> 200 session + "next": [one distribution after each token]

``rollback`` first forgets the session's last n tokens (rejected proposals), then ``tokens`` are fed in
one forward (a lagging member's catch-up, a proposal's verification). v1 stays as it was.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import torch
from fastapi import APIRouter, Response
from pydantic import BaseModel, ConfigDict, Field

from chorus.engines.core.base import INT_MAX
from chorus.engines.remote.session_wire import next_token
from chorus.errors import InvalidRequest, RateLimited, SessionBusy
from chorus.server.gateway.accounting import settle
from chorus.server.gateway.context import Context, Ctx
from chorus.server.gateway.held_sessions import Held
from chorus.server.resolve import admit, model

API_VERSION = "2"  # the newest this worker speaks (the header on every response); v1 paths stay served
router = APIRouter(prefix="/chorus/v1/sessions")
router_v2 = APIRouter(prefix="/chorus/v2/sessions")


class OpenBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    prompt: list[int] = Field(min_length=1)
    top_k: int | None = Field(default=None, ge=1, le=1000, description="return the k best logprobs, not logits")
    cache_salt: str | None = Field(default=None, min_length=1, max_length=512,
                                   description="narrows the caller's prefix-cache scope, as on the completions API")


class StepBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    token: int = Field(ge=0, le=INT_MAX)
    top_k: int | None = Field(default=None, ge=1, le=1000)


class StepBodyV2(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens: list[int] = Field(default_factory=list, max_length=512, description="fed in order, one forward")
    rollback: int = Field(default=0, ge=0, le=INT_MAX, description="tokens to forget before feeding `tokens`")
    top_k: int | None = Field(default=None, ge=1, le=1000)


def _body(held: Held, top_k: int | None, logits: torch.Tensor) -> dict[str, Any]:
    return {"id": held.id, "object": "chorus.session", "model": held.model, "length": held.length,
            "next": next_token(logits, top_k)}


@router.get("")
async def list_sessions(response: Response, ctx: Ctx) -> dict[str, Any]:
    store = ctx.services.sessions
    response.headers["X-Chorus-Session-API"] = API_VERSION
    mine = [h for h in store.held.values() if h.owner == ctx.owner]  # a key sees its own sessions only
    return {"object": "list", "open": len(mine), "max_open": store.max_open,
            "idle_timeout_s": store.idle_timeout_s, "expired": store.expired_by.get(ctx.owner, 0)}


@router.post("")
async def open_session(body: OpenBody, response: Response, ctx: Ctx) -> dict[str, Any]:
    store = ctx.services.sessions
    engine = model(ctx, body.model, "session")
    vocab = engine.tokenizer.vocab_size
    if any(t < 0 or t >= vocab for t in body.prompt):
        raise InvalidRequest(f"prompt holds token ids outside the vocabulary (0..{vocab - 1}).", param="prompt")
    if len(body.prompt) >= engine.max_model_len:
        raise InvalidRequest(f"prompt of {len(body.prompt)} tokens leaves no room in the context window of "
                             f"{engine.max_model_len}.", param="prompt", code="context_length_exceeded")
    if len(store.held) >= store.max_open:
        raise RateLimited(f"{store.max_open} sessions are open on this worker; close some or retry.", retry_after=1.0)
    check_share(ctx, body.model)
    # the key's tenant narrowed by the body's cache_salt (server/gateway/tenancy.py), for the session's life
    session = engine.open_session(ctx.request_scope(body))
    held = Held(secrets.token_urlsafe(12), body.model, session, vocab, len(body.prompt), ctx.owner)
    store.held[held.id] = held
    try:
        async with held.lock:
            logits = await session.prefill(body.prompt)
    except BaseException:
        store.close(held.id)
        raise
    held.last_used = time.monotonic()
    settle(ctx, body.model, {"prompt_tokens": len(body.prompt), "completion_tokens": 0})  # charged as any tokens
    response.headers["X-Chorus-Session-API"] = API_VERSION
    return _body(held, body.top_k, logits)


def check_share(ctx: Context, name: str) -> None:
    """A held session keeps one of its model's batch slots (``max_batch_size``) for as long as it is open, so
    sessions may take all of a model's slots but one (a chat of any key still runs), and one key at most half of
    them (``server.sessions.max_per_key`` sets another share, e.g. for the one key of a gateway in front):
    429 past either."""
    store, slots = ctx.services.sessions, ctx.config.model(name).max_batch_size
    on_model = [h for h in store.held.values() if h.model == name]
    mine = sum(1 for h in on_model if h.owner == ctx.owner)
    if slots > 1 and len(on_model) >= slots - 1:
        raise RateLimited(f"Sessions hold {len(on_model)} of {name}'s {slots} batch slots, all it lends to "
                          "sessions (one is kept for requests); close one or retry.", retry_after=1.0,
                          code="sessions_exhausted")
    share = store.max_per_key if store.max_per_key is not None else max(1, (slots - 1) // 2)
    if mine >= share:
        raise RateLimited(f"This key holds {mine} sessions on {name}, its share of the model's {slots} batch "
                          "slots; close one or retry.", retry_after=1.0, code="sessions_exhausted")


@router.post("/{sid}/step")
async def step_session(sid: str, body: StepBody, response: Response, ctx: Ctx) -> dict[str, Any]:
    held, logits = await _step(ctx, sid, [body.token], 0, "token")
    response.headers["X-Chorus-Session-API"] = API_VERSION
    assert logits is not None
    return _body(held, body.top_k, logits[-1])


@router_v2.post("/{sid}/step")
async def step_session_v2(sid: str, body: StepBodyV2, response: Response,
                          ctx: Ctx) -> dict[str, Any]:
    if not body.tokens and not body.rollback:
        raise InvalidRequest("a step needs tokens, a rollback, or both.", param="tokens")
    held, logits = await _step(ctx, sid, body.tokens, body.rollback, "tokens")
    response.headers["X-Chorus-Session-API"] = API_VERSION
    nexts = [] if logits is None else [next_token(row, body.top_k) for row in logits]
    return {"id": held.id, "object": "chorus.session", "model": held.model, "length": held.length, "next": nexts}


async def _step(ctx: Context, sid: str, tokens: list[int], rollback: int,
                param: str) -> tuple[Held, torch.Tensor | None]:
    """Roll back, then feed ``tokens`` in one forward: the session and the logits after each token."""
    store = ctx.services.sessions
    held = store.get(sid, ctx.owner)
    admit(ctx, held.model)
    if held.lock.locked():
        raise SessionBusy(f"session {sid} is still running its previous step.", param="id")
    bad = [t for t in tokens if t < 0 or t >= held.vocab_size]
    if bad:
        raise InvalidRequest(f"token {bad[0]} is outside the vocabulary (0..{held.vocab_size - 1}).", param=param)
    if rollback >= held.length:
        raise InvalidRequest(f"cannot roll back {rollback} of the session's {held.length} tokens.", param="rollback")
    async with held.lock:
        try:
            if rollback:
                held.session.rollback(rollback)
                held.length -= rollback
            logits = await held.session.extend(tokens) if tokens else None
        except InvalidRequest:
            raise
        except BaseException:  # failed or cancelled (client gone): the cache may hold the tokens, so end it
            store.close(sid)
            raise
    held.length += len(tokens)
    held.last_used = time.monotonic()
    if tokens:  # the tokens fed are charged as prompt tokens (the key's tpm window, budget and spend)
        settle(ctx, held.model, {"prompt_tokens": len(tokens), "completion_tokens": 0})
    return held, logits


@router.delete("/{sid}")
async def close_session(sid: str, response: Response, ctx: Ctx) -> dict[str, Any]:
    store = ctx.services.sessions
    held = store.get(sid, ctx.owner)
    admit(ctx, held.model)
    store.close(sid)
    response.headers["X-Chorus-Session-API"] = API_VERSION
    return {"id": sid, "object": "chorus.session", "deleted": True}


# v2 serves v1's open / list / delete unchanged (a v2 session is the same held session)
router_v2.add_api_route("", list_sessions, methods=["GET"])
router_v2.add_api_route("", open_session, methods=["POST"])
router_v2.add_api_route("/{sid}", close_session, methods=["DELETE"])
