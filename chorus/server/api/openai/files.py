"""``/v1/files``: upload, list, retrieve, download and delete files, as OpenAI's Files API (the Batch API's
inputs, purpose ``batch``, and its outputs, purpose ``batch_output``). A key sees only its own files: another
key's file id is a 404 like an unknown one."""

from __future__ import annotations

import unicodedata
from typing import Literal
from urllib.parse import quote

from fastapi import APIRouter, Form, Query, UploadFile
from fastapi.responses import FileResponse, Response

from chorus.errors import InvalidRequest, NotFound, RequestTooLarge
from chorus.server.batch.render import file_object
from chorus.server.batch.runner import batches_of
from chorus.server.gateway.context import Context, Ctx
from chorus.server.reply import json_response

router = APIRouter()
PURPOSES = ("batch",)  #: what may be uploaded (``batch_output`` files are written by batches only)


async def owned(ctx: Context, file_id: str) -> dict[str, object]:
    row = await (await batches_of(ctx).open()).file(file_id, ctx.owner or "")
    if row is None:
        raise NotFound(f"No file with id {file_id!r}.", param="file_id")
    return row


@router.post("/v1/files", response_model=None)
async def upload(ctx: Ctx, file: UploadFile, purpose: str = Form()) -> Response:
    batches = batches_of(ctx)
    if purpose not in PURPOSES:
        raise InvalidRequest(f"purpose {purpose!r} is not supported here; use one of: {', '.join(PURPOSES)}.",
                             param="purpose")
    limit = batches.options.max_file_bytes
    data = await file.read(limit + 1)
    if len(data) > limit:
        raise RequestTooLarge(f"The file is over this server's limit of {limit} bytes "
                              "(server.batches.max_file_bytes).", param="file")
    name = (file.filename or "upload.jsonl")[:255]
    if any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") for c in name):
        raise InvalidRequest("The file's name has a control or format character; name it with printable "
                             "characters.", param="file")
    store = await batches.open()
    quota, held = batches.options.max_bytes_per_key, await store.stored_bytes(ctx.owner or "")
    if held + len(data) > quota:
        raise RequestTooLarge(f"This key's files hold {held} bytes; with this upload ({len(data)} bytes) they would "
                              f"pass its quota of {quota} bytes (server.batches.max_bytes_per_key). Delete files "
                              "it no longer needs (DELETE /v1/files/{id}).", param="file")
    return json_response(file_object(await store.add_file(ctx.owner or "", purpose, name, data)))


@router.get("/v1/files", response_model=None)
async def list_files(ctx: Ctx, purpose: str | None = None, after: str | None = None,
                     limit: int = Query(default=10_000, ge=1, le=10_000),
                     order: Literal["asc", "desc"] = "desc") -> Response:
    rows = await (await batches_of(ctx).open()).files(ctx.owner or "", purpose, after, limit + 1, order)
    data = [file_object(r) for r in rows[:limit]]
    return json_response({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                          "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit})


@router.get("/v1/files/{file_id}", response_model=None)
async def retrieve(file_id: str, ctx: Ctx) -> Response:
    return json_response(file_object(await owned(ctx, file_id)))


@router.get("/v1/files/{file_id}/content", response_model=None)
async def content(file_id: str, ctx: Ctx) -> Response:
    row = await owned(ctx, file_id)
    store = await batches_of(ctx).open()
    path = store.local_path(file_id)
    headers = {"content-disposition": attachment(str(row["filename"]))}
    if path is not None:  # on this node's disk: streamed as it is
        return FileResponse(path, media_type="application/jsonl", headers=headers)
    return Response(await store.read(file_id), media_type="application/jsonl", headers=headers)


def attachment(filename: str) -> str:
    """A Content-Disposition for ``filename`` (RFC 6266): an ASCII ``filename`` for old clients (quotes,
    backslashes, control and non-ASCII characters replaced) and the exact name as UTF-8 in ``filename*``."""
    plain = "".join(c if " " <= c <= "~" and c not in '"\\' else "_" for c in filename) or "file"
    return f"attachment; filename=\"{plain}\"; filename*=UTF-8''{quote(filename, safe='')}"


@router.delete("/v1/files/{file_id}", response_model=None)
async def delete(file_id: str, ctx: Ctx) -> Response:
    if not await (await batches_of(ctx).open()).delete_file(file_id, ctx.owner or ""):
        raise NotFound(f"No file with id {file_id!r}.", param="file_id")
    return json_response({"id": file_id, "object": "file", "deleted": True})
