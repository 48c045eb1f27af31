"""A batch's input file, read and checked line by line before any line runs (the batch's ``validating`` step).

Each line is ``{"custom_id": ..., "method": "POST", "url": <the batch's endpoint>, "body": {...}}``; the body is
checked by the endpoint's own request model (the checks a live request gets before it is admitted) and its
``model`` must be one the batch's key may use (a model, a named ensemble, or an inline ``ensemble``). The first
bad lines fail the whole batch, each error naming its line (1-based, as OpenAI's ``errors.data[].line``); lines
may ask for different models (chorus runs each where it belongs; OpenAI refuses that, chorus has no reason to).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from chorus.server.batch.store import Line

MAX_ERRORS = 10  #: errors named per failed batch (the rest are the same kind of mistake, found once these are fixed)
MAX_CUSTOM_ID = 512


@dataclass
class LineError:
    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


def read_lines(data: bytes, endpoint: str, request_model: type[BaseModel], models: Collection[str], max_lines: int
               ) -> tuple[list[Line], list[LineError]]:
    """The file's requests to ``endpoint``, each body checked by ``request_model`` (the endpoint's, given by the API
    layer), or the errors that fail the batch."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return [], [LineError("invalid_file", f"The file is not UTF-8 ({exc.reason} at byte {exc.start}).")]
    lines: list[Line] = []
    errors: list[LineError] = []
    seen: dict[str, int] = {}
    raw_lines = text.split("\n")  # JSONL lines end at \n only: U+2028, U+0085 ... may sit inside a string
    raw_lines = [r.removesuffix("\r") for r in raw_lines]
    if sum(1 for r in raw_lines if r.strip()) > max_lines:
        return [], [LineError("too_many_requests", f"The file has more than {max_lines} requests, this server's "
                              "limit per batch (server.batches.max_lines).")]
    for n, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        error = check_line(raw, n, endpoint, models, request_model, seen)
        if isinstance(error, LineError):
            errors.append(error)
            if len(errors) >= MAX_ERRORS:
                break
        else:
            lines.append(Line(len(lines), *error))
    if not lines and not errors:
        errors.append(LineError("empty_file", "The file has no requests."))
    return lines, errors


def check_line(raw: str, n: int, endpoint: str, models: Collection[str], request_model: type[BaseModel],
               seen: dict[str, int]) -> LineError | tuple[str, dict[str, Any]]:
    try:
        item = json.loads(raw)
    except json.JSONDecodeError as exc:
        return LineError("invalid_json_line", f"Line {n} is not valid JSON: {exc.msg} (column {exc.colno}).", n)
    if not isinstance(item, dict):
        return LineError("invalid_request", f"Line {n} is not a JSON object.", n)
    unknown = sorted(set(item) - {"custom_id", "method", "url", "body"})
    if unknown:
        return LineError("invalid_request", f"Line {n} has unknown fields: {', '.join(unknown)}.", n, unknown[0])
    cid = item.get("custom_id")
    if not isinstance(cid, str) or not cid or len(cid) > MAX_CUSTOM_ID:
        return LineError("missing_custom_id", f"Line {n} needs a custom_id: a string of 1 to {MAX_CUSTOM_ID} "
                         "characters.", n, "custom_id")
    if cid in seen:
        return LineError("duplicate_custom_id", f"Line {n} repeats the custom_id {cid!r} of line {seen[cid]}; "
                         "each line's must be unique.", n, "custom_id")
    seen[cid] = n
    if item.get("method") != "POST":
        return LineError("invalid_method", f"Line {n}: method must be \"POST\".", n, "method")
    if item.get("url") != endpoint:
        return LineError("mismatched_url", f"Line {n}: url {item.get('url')!r} is not the batch's endpoint "
                         f"{endpoint!r}; every line must match it.", n, "url")
    body = item.get("body")
    if not isinstance(body, dict):
        return LineError("invalid_request", f"Line {n}: body must be a JSON object (the request).", n, "body")
    if body.get("stream"):
        return LineError("invalid_request", f"Line {n}: a batch line cannot stream (its answer goes to the output "
                         "file); leave stream out.", n, "body.stream")
    try:
        request_model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return LineError("invalid_request", f"Line {n}: body.{where}: {first['msg']}.", n, f"body.{where}")
    model = body.get("model")
    if "ensemble" not in body and model not in models:
        return LineError("model_not_found", f"Line {n}: the model {model!r} does not exist. Available models: "
                         f"{', '.join(sorted(models)) or 'none'}.", n, "body.model")
    return cid, body
