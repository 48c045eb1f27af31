"""The admin API. ``GET /admin/keys/{name}``: a key's window, requests in flight, budget and spend, read from the
``server.state`` store (so any replica answers for all of them). ``DELETE /admin/models/{name}/prefix-cache``:
drop what a model's prefix cache holds (this replica's). Both need the admin key (``Authorization: Bearer <admin
key>``, whose SHA-256 is ``server.state.admin_sha256``, or the key itself in ``CHORUS_ADMIN_KEY``, which wins);
without one configured the routes answer 404, as if absent."""

from __future__ import annotations

import hmac

from fastapi import APIRouter
from fastapi.responses import Response

from chorus.errors import AuthenticationFailed, InvalidRequest, ModelNotFound
from chorus.server.gateway.auth import hash_key
from chorus.server.gateway.context import Context, Ctx
from chorus.server.reply import json_response

router = APIRouter()


def check_admin(ctx: Context) -> None:
    admin = ctx.services.admin_sha256
    if admin is None:
        raise ModelNotFound("There is no admin API on this server (set server.state.admin_sha256 or CHORUS_ADMIN_KEY).", code="not_found")
    assert ctx.http is not None
    scheme, _, token = (ctx.http.headers.get("authorization") or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(hash_key(token.strip()), admin):
        raise AuthenticationFailed("The admin API needs the admin key: 'Authorization: Bearer <admin key>'.")


@router.get("/admin/keys/{name}", response_model=None)
async def key_report(name: str, ctx: Ctx) -> Response:
    check_admin(ctx)
    principal = next((p for p in ctx.services.keys.principals if p.name == name), None)
    if principal is None:
        raise ModelNotFound(f"No API key named {name!r}.", param="name", code="key_not_found")
    return json_response(await ctx.services.key_state.report(principal))


@router.delete("/admin/models/{name:path}/prefix-cache", response_model=None)
async def drop_prefix_cache(name: str, ctx: Ctx) -> Response:
    check_admin(ctx)
    engine = ctx.services.engines.get(name)
    if engine is None:
        raise ModelNotFound(f"No model named {name!r}.", param="name")
    drop = getattr(engine, "drop_prefix_cache", None)
    if drop is None:
        raise InvalidRequest(f"The model {name!r} has no prefix cache (its engine keeps none).", param="name")
    return json_response({"model": name, "dropped_tokens": await drop()})
