"""OpenAI request fields chorus does not serve yet, refused with a 400 that names the field.

Silently ignoring them would answer a different question than the one asked: an image part dropped from
a message loses what the user sent, a ``logit_bias`` never applied changes nothing the client can see. Fields that change nothing when ignored (``user``, ``metadata``, ``store``,
``service_tier``, ...) stay accepted, as on other
OpenAI-compatible servers.
"""

from __future__ import annotations

from typing import Any

from chorus.errors import InvalidRequest


def check_common(extra: dict[str, Any], body: Any) -> None:
    """Fields of both chat and text completions (``extra``: the fields the request model does not declare)."""
    if body.logit_bias:
        raise InvalidRequest("'logit_bias' is not supported by this server yet.", param="logit_bias")


def check_chat(extra: dict[str, Any], body: Any) -> None:
    check_common(extra, body)
    for field in ("prediction", "audio", "functions", "function_call"):
        if extra.get(field) is not None:
            raise InvalidRequest(f"'{field}' is not supported by this server.", param=field)
    modalities = extra.get("modalities")
    if modalities is not None and list(modalities) != ["text"]:
        raise InvalidRequest("The models of this server produce text only: 'modalities' may be [\"text\"].",
                             param="modalities")
    for i, m in enumerate(body.messages):
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise InvalidRequest(f"messages[{i}].content[{j}]: content parts of type {kind!r} are not "
                                         "supported; the models of this server read text parts only "
                                         "({'type': 'text', 'text': ...}).", param=f"messages[{i}].content[{j}]")
