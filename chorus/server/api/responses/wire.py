"""OpenAI's Responses shapes and the chat request they are served as.

``POST /v1/responses`` has no request path of its own: `ResponsesRequest.to_chat` turns its body (input items,
instructions, ``text.format``, function tools, the stored conversation of ``previous_response_id``) into the
`ChatCompletionRequest` the chat route serves, single model or ensemble; `response_body` and `ResponseEvents`
turn the chat route's JSON or chunks back into a Response object or the Responses event stream. A 400 from the
chat side names the Responses field (``messages`` -> ``input``, ``max_completion_tokens`` ->
``max_output_tokens``, ``response_format`` -> ``text.format``).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncGenerator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from chorus.errors import GatewayError, InvalidRequest
from chorus.server import protocol

#: fields of OpenAI's Responses API this server does not serve, with the reason the 400 gives
REFUSED = {
    "reasoning": "no model of this server reasons",
    "background": "responses run while the request is open (no background mode)",
    "include": "there are no extra output fields to include (no built-in tools, no reasoning)",
    "prompt": "there are no stored prompt templates",
    "conversation": "there are no stored conversations; chain responses with 'previous_response_id'",
    "top_logprobs": "logprobs are served on /v1/chat/completions",
    "max_tool_calls": "only function tools are served, and their calls are returned, never run",
    "stream_options": "the event stream has no options here",
    "service_tier": "there is one service tier",
    "prompt_cache_key": "there is no prompt cache to key",
    "safety_identifier": "there is no safety service to pass it to",
}
#: chat-side parameter names and the Responses fields a 400 should name instead
PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
          "response_format": "text.format"}
BUILT_IN_TOOLS = ("web_search", "web_search_preview", "file_search", "computer_use_preview", "code_interpreter",
                  "image_generation", "mcp", "local_shell", "shell", "apply_patch", "custom")


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def renamed(param: str | None) -> str | None:
    if param is None:
        return None
    head, dot, rest = param.partition(".")
    stem = head.split("[")[0]
    if stem in PARAMS:
        return PARAMS[stem] + head[len(stem):] + dot + rest
    return param


class ResponsesRequest(BaseModel):
    """The body of ``POST /v1/responses``. Unknown fields are refused by name (a client sending one expects it
    to do something), the chorus extensions ``ensemble`` and ``trace`` are accepted as on chat."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool = True
    previous_response_id: str | None = None
    truncation: str | None = None
    ensemble: dict[str, Any] | None = None
    trace: bool = False

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None and (len(v) > 16 or any(len(k) > 64 or len(x) > 512 for k, x in v.items())):
            raise ValueError("at most 16 pairs, keys up to 64 characters, values up to 512")
        return v

    def refuse_unknown(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if value is None:
                continue
            if name in REFUSED:
                raise InvalidRequest(f"'{name}' is not supported by this server: {REFUSED[name]}.", param=name)
            raise InvalidRequest(f"'{name}' is not a field of the Responses API this server serves.", param=name)
        if self.truncation not in (None, "disabled"):
            raise InvalidRequest("'truncation' may only be 'disabled' here: a conversation longer than the model's "
                                 "context is a 400, never cut.", param="truncation")
        if isinstance(self.input, list) and not self.input:
            raise InvalidRequest("'input' must not be empty.", param="input")

    # -- into the chat request ---------------------------------------------------------------------------------
    def messages(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.instructions:  # instructions apply to this response only (not carried by previous_response_id)
            out.append({"role": "system", "content": self.instructions})
        out += history
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        for i, item in enumerate(items):
            out.extend(input_item(item, f"input[{i}]", out))
        return out

    def chat_tools(self) -> list[dict[str, Any]] | None:
        if self.tools is None:
            return None
        out = []
        for i, t in enumerate(self.tools):
            kind = t.get("type")
            if kind in BUILT_IN_TOOLS:
                raise InvalidRequest(f"tools[{i}]: built-in tools ({kind!r}) are not served here; only tools of "
                                     "type 'function', whose calls come back to you as output items.",
                                     param=f"tools[{i}].type")
            if kind != "function":
                raise InvalidRequest(f"tools[{i}]: only tools of type 'function' are supported (got {kind!r}).",
                                     param=f"tools[{i}].type")
            fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
            out.append({"type": "function", "function": fn})
        return out

    def chat_tool_choice(self) -> Any:
        c = self.tool_choice
        if isinstance(c, dict):
            if c.get("type") != "function":
                raise InvalidRequest("'tool_choice' may be 'auto', 'none', 'required' or {'type': 'function', "
                                     "'name': ...} here.", param="tool_choice")
            return {"type": "function", "function": {"name": c.get("name")}}
        return c

    def response_format(self) -> dict[str, Any] | None:
        fmt = (self.text or {}).get("format")
        if set(self.text or {}) - {"format", "verbosity"}:
            bad = sorted(set(self.text or {}) - {"format", "verbosity"})[0]
            raise InvalidRequest(f"'text.{bad}' is not a field of 'text'.", param=f"text.{bad}")
        if (self.text or {}).get("verbosity") not in (None, "medium"):
            raise InvalidRequest("'text.verbosity' is not supported: the models here have no verbosity setting.",
                                 param="text.verbosity")
        if fmt is None or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_object":
            return {"type": "json_object"}
        if fmt.get("type") == "json_schema":
            spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
            return {"type": "json_schema", "json_schema": spec}
        raise InvalidRequest(f"text.format.type must be 'text', 'json_object' or 'json_schema' (got "
                             f"{fmt.get('type')!r}).", param="text.format.type")

    def to_chat(self, history: list[dict[str, Any]]) -> protocol.ChatCompletionRequest:
        """The chat request this response is served as (``history``: a previous response's conversation)."""
        self.refuse_unknown()
        body: dict[str, Any] = {
            "model": self.model, "messages": self.messages(history), "temperature": self.temperature,
            "top_p": self.top_p, "max_completion_tokens": self.max_output_tokens, "stream": self.stream,
            "tools": self.chat_tools(), "tool_choice": self.chat_tool_choice(),
            "parallel_tool_calls": self.parallel_tool_calls, "response_format": self.response_format(),
            "user": self.user, "ensemble": self.ensemble, "trace": self.trace,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        try:
            return protocol.ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except GatewayError as exc:
            exc.param = renamed(exc.param)
            raise
        except ValidationError as exc:
            err = exc.errors()[0]
            param = renamed(".".join(str(x) for x in err["loc"])) if err["loc"] else None
            raise InvalidRequest(f"{param}: {err['msg']}" if param else err["msg"], param=param) from None


def input_item(item: Any, where: str, before: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One input item as chat messages (a function call joins the assistant message before it)."""
    if not isinstance(item, dict):
        raise InvalidRequest(f"{where} must be an object (a message or a function call output).", param=where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise InvalidRequest(f"{where}.role must be 'user', 'system', 'developer' or 'assistant'.",
                                 param=f"{where}.role")
        return [{"role": role, "content": message_text(item.get("content"), where)}]
    if kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise InvalidRequest(f"{where}.{key} is required (a string).", param=f"{where}.{key}")
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        if before and before[-1]["role"] == "assistant" and "tool_calls" in before[-1]:
            before[-1]["tool_calls"].append(call)
            return []
        return [{"role": "assistant", "content": None, "tool_calls": [call]}]
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise InvalidRequest(f"{where}.call_id is required: the call this output answers.",
                                 param=f"{where}.call_id")
        output = item.get("output")
        text = output if isinstance(output, str) else message_text(output, f"{where}.output")
        return [{"role": "tool", "tool_call_id": item["call_id"], "content": text}]
    raise InvalidRequest(f"{where}: input items of type {kind!r} are not supported; send messages (text "
                         "content), function_call and function_call_output items.", param=f"{where}.type")


def message_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content must be a string or a list of text parts.", param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{where}.content[{j}]: content parts of type {kind!r} are not supported; the "
                                 "models of this server read text parts only ({'type': 'input_text', 'text': ...}).",
                                 param=f"{where}.content[{j}]")
        texts.append(part["text"])
    return "".join(texts)


# -- out of the chat reply --------------------------------------------------------------------------------------
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
