"""Anthropic's Messages API as chat: the request converted to a chat completion request (one way), the chat reply
converted to a message, or the chat chunks to Anthropic's named events (the other way). server/api/anthropic/routes.py serves
it through the chat route, as the Responses API is served.

What maps: ``system`` (a string or text blocks), ``messages`` with text, ``tool_use`` and ``tool_result`` blocks,
``tools`` (``input_schema`` as the function's parameters) and ``tool_choice`` (auto, any, tool, none),
``max_tokens`` (required), ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``metadata.user_id``,
``stream``, ``cache_control`` markers (the prefix cache keeps every prompt's prefix anyway; reads are reported as
``cache_read_input_tokens``); chorus's own ``ensemble`` and ``trace``. What chorus does not serve is a 400 that
names it (images, documents, ``thinking``, server tools, citations, a cache TTL, ``service_tier``, ``container``,
``mcp_servers``, ``output_config`` ...), never ignored.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from chorus.engines.core.base import INT_MAX
from chorus.errors import InvalidRequest
from chorus.server.wire import request as wire

#: request fields Anthropic defines that chorus does not serve, and why
NOT_SERVED = {
    "thinking": "extended thinking is not served",
    "service_tier": "chorus has no service tiers",
    "container": "chorus runs no containers (no server tools)",
    "mcp_servers": "chorus connects to no MCP servers",
    "context_management": "chorus does not edit the context",
    "output_config": "use tools, or the chat API's response_format, for structured output",
    "speed": "chorus has one speed",
    "inference_geo": "chorus runs where it is deployed",
    "diagnostics": "not served",
    "user_profile_id": "chorus has no user profiles",
    "workspace_id": "chorus has no workspaces",
}
#: ``cache_control`` chorus honours: its prefix cache keeps every prompt's prefix anyway (no TTL: least recently
#: used prefixes are evicted), so only the plain marker is accepted
CACHE_MARKER = {"type": "ephemeral"}
BLOCKS_NOT_SERVED = {"image", "document", "search_result", "thinking", "redacted_thinking", "server_tool_use",
                     "web_search_tool_result", "container_upload"}


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    """``POST /v1/messages`` (and ``/v1/messages/count_tokens``, where ``max_tokens`` may be left out)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=INT_MAX)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1, le=INT_MAX)
    metadata: dict[str, Any] | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    ensemble: dict[str, Any] | None = None  # chorus's extension, as on chat
    trace: bool = False

    def refuse_unknown(self) -> None:
        extra = dict(self.model_extra or {})
        check_cache_control(extra.pop("cache_control", None), "cache_control")
        for key in extra:
            why = NOT_SERVED.get(key, "not a field of the Messages API")
            raise InvalidRequest(f"'{key}' is not supported: {why}.", param=key)
        if self.metadata is not None and set(self.metadata) - {"user_id"}:
            field = sorted(set(self.metadata) - {"user_id"})[0]
            raise InvalidRequest(f"metadata.{field}: only 'user_id' is a metadata field.", param=f"metadata.{field}")

    def chat_messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.system is not None:
            out.append({"role": "system", "content": text_of(self.system, "system")})
        calls: set[str] = set()  # the tool_use ids of the previous assistant turn: what a tool_result may answer
        for i, m in enumerate(self.messages):
            turns = chat_turns(m, f"messages[{i}]", calls)
            calls = {c["id"] for t in turns for c in t.get("tool_calls") or []}
            out += turns
        return out

    def chat_tools(self) -> list[dict[str, Any]] | None:
        if self.tools is None:
            return None
        out = []
        for i, t in enumerate(self.tools):
            where = f"tools[{i}]"
            if t.get("type") not in (None, "custom"):
                raise InvalidRequest(f"{where}: server tools ('{t.get('type')}') are not served; only client tools "
                                     "(name, description, input_schema).", param=f"{where}.type")
            check_cache_control(t.get("cache_control"), f"{where}.cache_control")
            unknown = sorted(set(t) - {"name", "description", "input_schema", "type", "cache_control"})
            if unknown:
                raise InvalidRequest(f"{where}.{unknown[0]} is not supported.", param=f"{where}.{unknown[0]}")
            if not isinstance(t.get("name"), str) or not isinstance(t.get("input_schema"), dict):
                raise InvalidRequest(f"{where} needs 'name' (a string) and 'input_schema' (a JSON schema object).",
                                     param=where)
            fn = {"name": t["name"], "parameters": t["input_schema"]}
            if t.get("description"):
                fn["description"] = t["description"]
            out.append({"type": "function", "function": fn})
        return out

    def chat_tool_choice(self) -> Any:
        c = self.tool_choice
        if c is None:
            return None
        kind = c.get("type")
        if set(c) - {"type", "name", "disable_parallel_tool_use"}:
            extra = sorted(set(c) - {"type", "name", "disable_parallel_tool_use"})[0]
            raise InvalidRequest(f"tool_choice.{extra} is not supported.", param=f"tool_choice.{extra}")
        if kind == "tool":
            if not isinstance(c.get("name"), str):
                raise InvalidRequest("tool_choice of type 'tool' needs 'name'.", param="tool_choice.name")
            return {"type": "function", "function": {"name": c["name"]}}
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(str(kind))
        if choice is None:
            raise InvalidRequest("tool_choice.type must be 'auto', 'any', 'tool' or 'none'.", param="tool_choice.type")
        return choice

    def to_chat(self, *, need_max_tokens: bool = True) -> wire.ChatCompletionRequest:
        self.refuse_unknown()
        if need_max_tokens and self.max_tokens is None:
            raise InvalidRequest("max_tokens: Field required (the Messages API requires it).", param="max_tokens")
        body: dict[str, Any] = {
            "model": self.model, "messages": self.chat_messages(), "max_tokens": self.max_tokens,
            "stop": self.stop_sequences or None, "temperature": self.temperature, "top_p": self.top_p,
            "top_k": self.top_k, "stream": self.stream, "tools": self.chat_tools(),
            "tool_choice": self.chat_tool_choice(), "user": (self.metadata or {}).get("user_id"),
            "ensemble": self.ensemble, "trace": self.trace or None,
        }
        if (self.tool_choice or {}).get("disable_parallel_tool_use"):
            body["parallel_tool_calls"] = False
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        try:
            return wire.ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as exc:
            err = exc.errors()[0]
            param = ".".join(str(x) for x in err["loc"]) or None
            raise InvalidRequest(f"{param}: {err['msg']}" if param else err["msg"], param=param) from None


def text_of(content: str | list[dict[str, Any]], where: str) -> str:
    """A string, or text blocks joined (``system``, a tool result's content)."""
    if isinstance(content, str):
        return content
    parts = []
    for j, block in enumerate(content):
        check_block(block, f"{where}[{j}]", ("text",))
        parts.append(block["text"])
    return "".join(parts)


def check_block(block: Any, where: str, allowed: tuple[str, ...]) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise InvalidRequest(f"{where} must be a content block (an object with a 'type').", param=where)
    kind = block["type"]
    if kind in BLOCKS_NOT_SERVED:
        raise InvalidRequest(f"{where}: '{kind}' content is not supported by this server (text, tool_use and "
                             "tool_result are).", param=f"{where}.type")
    if kind not in allowed:
        raise InvalidRequest(f"{where}: a '{kind}' block is not valid here (expected: {', '.join(allowed)}).",
                             param=f"{where}.type")
    if block.get("citations") is not None:
        raise InvalidRequest(f"{where}.citations is not supported by this server.", param=f"{where}.citations")
    check_cache_control(block.get("cache_control"), f"{where}.cache_control")
    if kind == "text" and not isinstance(block.get("text"), str):
        raise InvalidRequest(f"{where}.text is required (a string).", param=f"{where}.text")
    return str(kind)


def check_cache_control(value: Any, where: str) -> None:
    """``cache_control``: the plain ephemeral marker is honoured by the prefix cache (every prompt's prefix is kept
    anyway); a TTL or another type is a 400, never ignored."""
    if value is not None and value != CACHE_MARKER:
        raise InvalidRequest(f"{where}: only {{'type': 'ephemeral'}} is supported (chorus's prefix cache keeps every "
                             "prompt's prefix, least recently used first out, with no TTL).", param=where)


def chat_turns(m: AnthropicMessage, where: str, calls_before: Collection[str] = ()) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user's tool results become ``tool`` messages (before its text);
    an assistant's tool_use blocks become its ``tool_calls``. A tool result must answer a ``tool_use`` of the
    previous assistant turn (``calls_before``: their ids), as Anthropic's API requires (400 otherwise)."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    allowed = ("text", "tool_use") if m.role == "assistant" else ("text", "tool_result")
    for j, block in enumerate(m.content):
        at = f"{where}.content[{j}]"
        kind = check_block(block, at, allowed)
        if kind == "text":
            text.append(block["text"])
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise InvalidRequest(f"{at} needs 'id' and 'name'.", param=at)
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
        else:  # tool_result
            if not isinstance(block.get("tool_use_id"), str):
                raise InvalidRequest(f"{at}.tool_use_id is required.", param=f"{at}.tool_use_id")
            if block["tool_use_id"] not in calls_before:
                raise InvalidRequest(f"{at}.tool_use_id: unexpected tool_use_id {block['tool_use_id']!r} in a "
                                     "tool_result block: each tool_result must answer a tool_use block of the "
                                     "previous (assistant) message.", param=f"{at}.tool_use_id")
            content = block.get("content", "")
            body = text_of(content, f"{at}.content") if isinstance(content, list | str) else str(content)
            if block.get("is_error"):
                body = f"Error: {body}"
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": body})
    if m.role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
        if calls:
            msg["tool_calls"] = calls
        return [msg]
    return results + ([{"role": "user", "content": "".join(text)}] if text or not results else [])
