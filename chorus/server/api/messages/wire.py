"""Anthropic's Messages API as chat: the request converted to a chat completion request (one way), the chat reply
converted to a message, or the chat chunks to Anthropic's named events (the other way). server/messages.py serves
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
import time
import uuid
from collections.abc import AsyncGenerator, Collection
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from chorus.errors import GatewayError, InvalidRequest
from chorus.server import protocol

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
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    """``POST /v1/messages`` (and ``/v1/messages/count_tokens``, where ``max_tokens`` may be left out)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)
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

    def to_chat(self, *, need_max_tokens: bool = True) -> protocol.ChatCompletionRequest:
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
            return protocol.ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
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


def message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def usage_of(chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    u = chat_usage or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": u.get("prompt_tokens", 0) - cached, "output_tokens": u.get("completion_tokens", 0),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function") or {}
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": call.get("id") or "toolu_" + uuid.uuid4().hex[:24], "name": fn.get("name", ""),
            "input": args}


def stop_of(choice: dict[str, Any], stop_sequences: list[str] | None) -> tuple[str, str | None]:
    finish = choice.get("finish_reason") or "stop"
    matched = choice.get("stop_reason")
    if finish == "stop" and isinstance(matched, str) and matched in (stop_sequences or []):
        return "stop_sequence", matched
    return STOP_REASONS.get(finish, "end_turn"), None


class MessagesState:
    """One request's Anthropic view: the id, the model, what the chat reply said."""

    def __init__(self, req: MessagesRequest) -> None:
        self.req = req
        self.id = message_id()
        self.created = int(time.time())

    def from_chat(self, chat: dict[str, Any]) -> dict[str, Any]:
        choice = chat["choices"][0]
        message = choice.get("message") or {}
        content: list[dict[str, Any]] = []
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        content += [tool_use_block(c) for c in message.get("tool_calls") or []]
        stop_reason, stop_sequence = stop_of(choice, self.req.stop_sequences)
        out = {"id": self.id, "type": "message", "role": "assistant", "model": self.req.model, "content": content,
               "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage_of(chat.get("usage"))}
        out.update({k: chat[k] for k in ("ensemble", "trace") if k in chat})
        return out


class MessageEvents:
    """The chat route's chunks as Anthropic's event stream: ``message_start``, a ``ping``, per content block
    ``content_block_start`` / ``content_block_delta`` (``text_delta``, or a tool call's ``input_json_delta``) /
    ``content_block_stop``, then ``message_delta`` (stop reason, output tokens) and ``message_stop``; a failure
    after the first byte is an ``error`` event."""

    def __init__(self, state: MessagesState) -> None:
        self.state = state
        self.index = -1  # the open content block's index
        self.open_kind: str | None = None
        self.finish: dict[str, Any] = {}
        self.usage: dict[str, Any] | None = None
        self.extra: dict[str, Any] = {}

    def start(self) -> dict[str, Any]:
        message: dict[str, Any] = {"id": self.state.id, "type": "message", "role": "assistant",
                                   "model": self.state.req.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": 0, "output_tokens": 0}}
        return {"type": "message_start", "message": message}

    def close(self) -> list[dict[str, Any]]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [{"type": "content_block_stop", "index": self.index}]

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self.open_kind != "text":
                    out += self.close()
                    self.index += 1
                    self.open_kind = "text"
                    out.append({"type": "content_block_start", "index": self.index,
                                "content_block": {"type": "text", "text": ""}})
                out.append({"type": "content_block_delta", "index": self.index,
                            "delta": {"type": "text_delta", "text": delta["content"]}})
            for call in delta.get("tool_calls") or []:
                out += self.close()
                self.index += 1
                block = tool_use_block(call)
                out += [{"type": "content_block_start", "index": self.index,
                         "content_block": {**block, "input": {}}},
                        {"type": "content_block_delta", "index": self.index,
                         "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}},
                        {"type": "content_block_stop", "index": self.index}]
            if choice.get("finish_reason"):
                self.finish = choice
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        self.extra.update({k: chunk[k] for k in ("ensemble", "trace") if k in chunk})
        return out

    async def run(self, chunks: AsyncGenerator[dict[str, Any], None]) -> AsyncGenerator[dict[str, Any], None]:
        yield self.start()
        yield {"type": "ping"}
        try:
            async for chunk in chunks:
                for e in self.chunk(chunk):
                    yield e
        except GatewayError as exc:
            yield {"type": "error", "error": {"type": error_type(exc.status), "message": exc.message}}
            return
        finally:
            await chunks.aclose()
        for e in self.close():
            yield e
        stop_reason, stop_sequence = stop_of(self.finish, self.state.req.stop_sequences)
        usage = usage_of(self.usage)
        yield {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
               "usage": {"output_tokens": usage["output_tokens"], "input_tokens": usage["input_tokens"],
                         "cache_read_input_tokens": usage["cache_read_input_tokens"]}, **self.extra}
        yield {"type": "message_stop"}


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               529: "overloaded_error"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
