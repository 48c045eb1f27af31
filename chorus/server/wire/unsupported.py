"""OpenAI chat fields chorus does not serve, refused with a 400 that names the field.

Silently ignoring them would answer a different question than the one asked: an image part dropped from
a message loses what the user sent, audio asked for never comes. Fields that change nothing when ignored
(``user``, ``metadata``, ``store``, ``service_tier``, ...) stay accepted, as on other OpenAI-compatible
servers. ``reasoning_effort`` is refused too: no model served here reasons, so the field would change
nothing. (Structured outputs, tools and ``logit_bias`` are served: server/wire/structured.py, server/wire/tools.py.)
"""

from __future__ import annotations

from typing import Any

from chorus.errors import InvalidRequest


def check_chat(extra: dict[str, Any], body: Any) -> None:
    """``extra``: the body as sent (the fields the request model does not declare too)."""
    for field in ("prediction", "audio", "functions", "function_call"):
        if extra.get(field) is not None:
            raise InvalidRequest(f"'{field}' is not supported by this server.", param=field)
    if extra.get("reasoning_effort") is not None:
        raise InvalidRequest("'reasoning_effort' is not supported: no model of this server reasons, so it would "
                             "change nothing.", param="reasoning_effort")
    modalities = extra.get("modalities")
    if modalities is not None and list(modalities) != ["text"]:
        raise InvalidRequest("The models of this server produce text only: 'modalities' may be [\"text\"].",
                             param="modalities")
    for i, m in enumerate(body.messages):
        if m.role == "tool" and not isinstance(getattr(m, "tool_call_id", None), str):
            raise InvalidRequest(f"messages[{i}]: a message with role 'tool' needs 'tool_call_id' (the id of the "
                                 "call it answers).", param=f"messages[{i}].tool_call_id")
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise InvalidRequest(f"messages[{i}].content[{j}]: content parts of type {kind!r} are not "
                                         "supported; the models of this server read text parts only "
                                         "({'type': 'text', 'text': ...}).", param=f"messages[{i}].content[{j}]")
