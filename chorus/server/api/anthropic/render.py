"""Anthropic's Messages API replies, from the chat route's: the message, its content blocks and usage, and the
stream's named events (``message_start`` ... ``message_stop``); the error types of Anthropic's envelope."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from chorus.errors import GatewayError
from chorus.server.api.anthropic.wire import MessagesRequest
from chorus.server.gateway.errors import error_type

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


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
