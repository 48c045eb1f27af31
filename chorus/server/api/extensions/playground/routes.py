"""``/playground``: a page that compares models and ensembles side by side and draws how an ensemble
answered from its trace. Plain static files inside the package (``chorus/server/api/extensions/playground/``: HTML, CSS,
one ES module; no build step, no CDN, no network beyond this server), calling chorus's own API from the
browser with the key the user types. Off with ``server.playground: false``.

The files are served with a Content-Security-Policy that allows this origin only, so the page cannot load
anything from elsewhere even by mistake."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import RedirectResponse, Response

from chorus.errors import ModelNotFound
from chorus.server.gateway.context import Ctx

router = APIRouter()

FILES = {"index.html": "text/html; charset=utf-8", "playground.css": "text/css; charset=utf-8",
         "playground.js": "text/javascript; charset=utf-8", "traces.js": "text/javascript; charset=utf-8"}
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def asset(name: str) -> bytes:
    return resources.files("chorus.server.api.extensions.playground").joinpath(name).read_bytes()


@router.get("/playground", include_in_schema=False)
async def playground_root() -> Response:
    return RedirectResponse("/playground/", status_code=307)


@router.get("/playground/{name:path}", include_in_schema=False)
async def playground_file(name: str, ctx: Ctx) -> Response:
    name = name or "index.html"
    if not ctx.config.server.playground or name not in FILES:
        raise ModelNotFound(f"No such page: /playground/{name}.", code="not_found")
    return Response(asset(name), media_type=FILES[name],
                    headers={"Content-Security-Policy": CSP, "Cache-Control": "no-cache",
                             "X-Content-Type-Options": "nosniff"})
