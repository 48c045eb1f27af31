"""OpenAI's Responses shapes and the chat request they are served as.

``POST /v1/responses`` has no request path of its own: `ResponsesRequest.to_chat` turns its body (input items,
instructions, ``text.format``, function tools, the stored conversation of ``previous_response_id``) into the
`ChatCompletionRequest` the chat route serves, single model or ensemble; `response_body` and `ResponseEvents`
turn the chat route's JSON or chunks back into a Response object or the Responses event stream. A 400 from the
chat side names the Responses field (``messages`` -> ``input``, ``max_completion_tokens`` ->
``max_output_tokens``, ``response_format`` -> ``text.format``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from chorus.engines.core.base import INT_MAX
from chorus.errors import GatewayError, InvalidRequest
from chorus.server.wire import request as wire

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
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT_MAX)
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

    def to_chat(self, history: list[dict[str, Any]]) -> wire.ChatCompletionRequest:
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
            return wire.ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
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
