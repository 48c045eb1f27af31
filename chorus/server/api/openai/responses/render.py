"""OpenAI's Responses API replies, from the chat route's: the response object, its output items and usage, and
the stream's typed events (``response.created`` ... ``response.completed``)."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncGenerator
from typing import Any

from chorus.errors import GatewayError
from chorus.server.api.openai.responses.wire import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def usage_of(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not chat_usage:
        return None
    cached = chat_usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    content = [] if status == "in_progress" else [{"type": "output_text", "text": text, "annotations": [],
                                                   "logprobs": []}]
    return {"id": item_id or new_id("msg"), "type": "message", "status": status, "role": "assistant",
            "content": content}


def call_item(call: dict[str, Any], status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or new_id("fc"), "type": "function_call", "status": status, "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"]}


class ResponseState:
    """One response being answered: the request, its id, its creation time and what it has produced."""

    def __init__(self, req: ResponsesRequest) -> None:
        self.req = req
        self.id = new_id("resp")
        self.created = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None
        self.finish: str | None = None
        self.extra: dict[str, Any] = {}  #: chorus's trailer fields (``ensemble``, ``trace``)
        self.error: dict[str, Any] | None = None

    @property
    def status(self) -> str:
        if self.error is not None:
            return "failed"
        return "incomplete" if self.finish == "length" else "completed"

    def body(self, status: str | None = None) -> dict[str, Any]:
        r, status = self.req, status or self.status
        text = {"format": (r.text or {}).get("format") or {"type": "text"}}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": self.error, "model": r.model, "output": self.output if status != "in_progress" else [],
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "metadata": r.metadata or {},
            "parallel_tool_calls": r.parallel_tool_calls is not False, "previous_response_id": r.previous_response_id,
            "store": r.store, "temperature": r.temperature, "top_p": r.top_p, "text": text,
            "tool_choice": r.tool_choice or "auto", "tools": r.tools or [], "truncation": r.truncation or "disabled",
            "user": r.user, "usage": self.usage if status != "in_progress" else None,
            **({"completed_at": int(time.time())} if status == "completed" else {}), **self.extra,
        }

    def from_chat(self, chat: dict[str, Any]) -> dict[str, Any]:
        """A finished chat completion as this response."""
        choice = chat["choices"][0]
        message = choice["message"]
        if message.get("content"):
            status = "incomplete" if choice["finish_reason"] == "length" else "completed"
            self.output.append(message_item(message["content"], status))
        self.output += [call_item(c) for c in message.get("tool_calls") or []]
        self.finish, self.usage = choice["finish_reason"], usage_of(chat.get("usage"))
        self.extra = {k: chat[k] for k in ("ensemble", "trace") if k in chat}
        return self.body()

    def conversation(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages a later response with ``previous_response_id`` continues from (instructions left out)."""
        out = messages[1:] if self.req.instructions else list(messages)
        calls = [{"id": o["call_id"], "type": "function", "function": {"name": o["name"], "arguments": o["arguments"]}}
                 for o in self.output if o["type"] == "function_call"]
        text = "".join(c["text"] for o in self.output if o["type"] == "message" for c in o["content"])
        out.append({"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})})
        return out


class ResponseEvents:
    """The chat route's chunks as the Responses event stream: ``response.created``, ``response.in_progress``,
    per output item ``output_item.added`` ... ``output_item.done`` (text deltas, or a function call's
    arguments), then ``response.completed`` (or ``response.incomplete`` at the token limit, or ``error`` and
    ``response.failed`` when the answer fails after the first byte). Every event has its ``sequence_number``."""

    def __init__(self, state: ResponseState) -> None:
        self.state = state
        self.seq = 0
        self.text_item: dict[str, Any] | None = None
        self.text = ""

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def open_text(self) -> list[dict[str, Any]]:
        self.text_item = message_item("", "in_progress")
        index = len(self.state.output)
        self.state.output.append(self.text_item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self.event("response.output_item.added", output_index=index, item=self.text_item),
                self.event("response.content_part.added", item_id=self.text_item["id"], output_index=index,
                           content_index=0, part=part)]

    def close_text(self) -> list[dict[str, Any]]:
        if self.text_item is None:
            return []
        item, index = self.text_item, self.state.output.index(self.text_item)
        done = message_item(self.text, "incomplete" if self.state.finish == "length" else "completed", item["id"])
        self.state.output[index] = done
        self.text_item = None
        part = done["content"][0]
        return [self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=self.text, logprobs=[]),
                self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=index, item=done)]

    def call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        index, item = len(self.state.output), call_item(call, "in_progress")
        self.state.output.append(item)
        done = {**item, "status": "completed"}
        out = [self.event("response.output_item.added", output_index=index, item={**item, "arguments": ""}),
               self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                          delta=item["arguments"]),
               self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                          name=item["name"], arguments=item["arguments"]),
               self.event("response.output_item.done", output_index=index, item=done)]
        self.state.output[index] = done
        return out

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self.text_item is None:
                    out += self.open_text()
                item = self.text_item
                assert item is not None
                self.text += delta["content"]
                out.append(self.event("response.output_text.delta", item_id=item["id"],
                                      output_index=self.state.output.index(item), content_index=0,
                                      delta=delta["content"], logprobs=[]))
            for call in delta.get("tool_calls") or []:
                out += self.close_text() + self.call(call)
            if choice.get("finish_reason"):
                self.state.finish = choice["finish_reason"]
        if chunk.get("usage"):
            self.state.usage = usage_of(chunk["usage"])
        self.state.extra.update({k: chunk[k] for k in ("ensemble", "trace") if k in chunk})
        return out

    async def run(self, chunks: AsyncGenerator[dict[str, Any], None]) -> AsyncGenerator[dict[str, Any], None]:
        yield self.event("response.created", response=self.state.body("in_progress"))
        yield self.event("response.in_progress", response=self.state.body("in_progress"))
        try:
            async for chunk in chunks:
                for e in self.chunk(chunk):
                    yield e
        except GatewayError as exc:
            self.state.error = {"code": exc.code or "server_error", "message": exc.message}
            yield self.event("error", code=exc.code, message=exc.message, param=exc.param)
            yield self.event("response.failed", response=self.state.body())
            return
        finally:
            await chunks.aclose()
        for e in self.close_text():
            yield e
        status = self.state.status
        yield self.event("response.completed" if status == "completed" else "response.incomplete",
                         response=self.state.body())
