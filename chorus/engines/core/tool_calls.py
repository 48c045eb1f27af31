"""Function calling on any model: the prompt that offers the functions, the grammar that forces a call, and
the parser that reads calls back out of the text.

Two call formats:

- **native**: a model whose chat template takes ``tools`` (Qwen2.5's: Hermes style) sees them through its
  own template and writes ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks, as it
  was trained to; earlier calls and tool results go through the template too.
- **json** (the fallback, for templates without tool support: SmolLM2's, Gemma's): the functions are
  described in a system message, and a call is the whole answer as a JSON list
  ``[{"name": ..., "arguments": {...}}]``; earlier calls are shown as that JSON, tool results as user turns.
  LiteLLM does the same for models without native function calling.

``tool_choice`` ``required`` or a named function turns into a grammar (an llguidance Lark grammar for the
native blocks, a JSON schema for the fallback), so the model must call, with arguments valid for the
function's schema, on any model. ``auto`` leaves the model free: the answer is a call if it parses as one
(known name, arguments valid against the schema; a call object or list alone in a markdown code block, as
small models often write it, counts too), else text.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

import jsonschema

from chorus.engines.core.base import Constraint, Tools
from chorus.engines.core.constraint import JSON_OPTIONS
from chorus.engines.core.hf_tokenizer import message_text

NATIVE_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
FENCE = re.compile(r"^```[a-zA-Z]*\s*\n(.*?)\n?```$", re.S)
FALLBACK_SYSTEM = (
    "You can call these functions:\n{functions}\n\n"
    "To call functions, answer with only a JSON list of calls and nothing else, e.g. "
    '[{{"name": "<function name>", "arguments": {{<arguments as a JSON object>}}}}].\n'
    "{rule}"
)
RULES = {
    "auto": "If no function is needed, answer the user normally in text.",
    "required": "You must call at least one function.",
}


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or "call_" + secrets.token_hex(12)

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}

    @property
    def key(self) -> str:
        """Equal calls (same name, same arguments) have equal keys: ensembles vote on them."""
        return json.dumps({"name": self.name, "arguments": self.arguments}, sort_keys=True)


def prepare(messages: list[dict[str, Any]], tools: Tools | None, native: bool) -> list[dict[str, Any]]:
    """The messages as the model's template should see them. Native: tool calls' arguments as objects (the
    templates serialise them; OpenAI sends a JSON string). Fallback: functions in a system message, calls as
    the JSON the model would write, tool results as user turns."""
    if native:
        return [_native_message(m) for m in messages]
    out = [_fallback_message(m) for m in messages]
    if tools is None:
        return out
    rule = RULES.get(tools.choice, f"You must call the function {tools.choice!r}.")
    if not tools.parallel:
        rule += " Call at most one function."
    functions = "\n".join(json.dumps(f, ensure_ascii=False) for f in tools.functions)
    system = FALLBACK_SYSTEM.format(functions=functions, rule=rule)
    if out and out[0]["role"] in ("system", "developer"):
        return [{"role": out[0]["role"], "content": f"{out[0].get('content') or ''}\n\n{system}"}, *out[1:]]
    return [{"role": "system", "content": system}, *out]


def _arguments(call: dict[str, Any]) -> tuple[str, Any]:
    fn = call.get("function") or {}
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass  # the template writes the string as sent
    return str(fn.get("name", "")), args


def _native_message(m: dict[str, Any]) -> dict[str, Any]:
    if m.get("role") != "assistant" or not m.get("tool_calls"):
        return m
    calls = []
    for c in m["tool_calls"]:
        name, args = _arguments(c)
        calls.append({**c, "function": {"name": name, "arguments": args}})
    return {**m, "tool_calls": calls}


def _fallback_message(m: dict[str, Any]) -> dict[str, Any]:
    role = m.get("role")
    if role == "assistant" and m.get("tool_calls"):
        calls = [dict(zip(("name", "arguments"), _arguments(c))) for c in m["tool_calls"]]
        text = (m.get("content") or "") + json.dumps(calls, ensure_ascii=False)
        return {"role": "assistant", "content": text}
    if role == "tool":
        return {"role": "user", "content": f"Result of the function call {m.get('tool_call_id', '')}: "
                                           f"{message_text(m.get('content'))}"}
    return m


def _call_schema(tools: Tools) -> dict[str, Any]:
    """One call: {"name": <a function offered>, "arguments": <its parameters>}."""
    fns = [f for f in tools.functions if tools.choice in ("auto", "required") or f["name"] == tools.choice]
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                       "required": ["name", "arguments"], "additionalProperties": False} for f in fns]}


#: the native block's tags as quoted Lark text
TEXT_TAGS = ('"<tool_call>"', '"</tool_call>"')


def tag_terms(tok: Any) -> tuple[str, str]:
    """The Lark terms for ``<tool_call>`` / ``</tool_call>`` on this tokenizer: a reference to the token itself
    where the vocabulary has it as one added token (Qwen2.5: llguidance treats added tokens as special, so the
    quoted text would not match them), else the quoted text."""
    def term(tag: str) -> str:
        return tag if len(tok.encode_text(tag)) == 1 else json.dumps(tag)
    return term("<tool_call>"), term("</tool_call>")


def constraint(tools: Tools, native: bool, tags: tuple[str, str] = TEXT_TAGS) -> Constraint | None:
    """The grammar that forces a call (``required`` or a named function); None for ``auto``. ``tags``: the
    native block's Lark terms (`tag_terms`)."""
    if tools.choice == "auto":
        return None
    one = _call_schema(tools)
    if not native:
        calls: dict[str, Any] = {"type": "array", "items": one, "minItems": 1}
        if not tools.parallel:
            calls["maxItems"] = 1
        return Constraint.json_schema(calls, param="tool_choice")
    compact = {**one, "x-guidance": JSON_OPTIONS}  # as response formats: no free whitespace inside the call
    block = f'{tags[0]} "\\n" %json {json.dumps(compact)} "\\n" {tags[1]}'
    more = "" if not tools.parallel else ' ("\\n" call)*'
    return Constraint("grammar", f"start: call{more}\ncall: {block}", param="tool_choice")


def parse(text: str, tools: Tools, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) from a model's answer in either format. Calls must name an offered function with
    arguments valid for its schema; anything else stays text. Identical calls in one answer count once (a model
    that writes the same call again is looping, not asking twice).

    ``cut``: the answer ended at ``max_tokens``. Then the calls it completed are kept (a JSON list cut after its
    second call holds two; a native block without its closing tag is dropped), and under a forced choice
    (``required``, a named function) the grammar's unfinished text is never the content: the reply is the
    completed calls, or nothing."""
    forced = tools.choice != "auto"
    blocks = NATIVE_CALL.findall(text)
    if blocks:
        calls = [_checked(b, tools) for b in blocks]
        if all(c is not None for c in calls):
            content = NATIVE_CALL.sub("", text)
            if cut:
                content = content.split("<tool_call>", 1)[0]  # an unfinished block: not content
            return content.strip() or None, distinct([c for c in calls if c is not None])
        return text, []
    stripped = FENCE.sub(r"\1", text.strip())  # small models often wrap the JSON in a markdown code block
    if stripped.startswith(("[", "{")):
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError:
            if not cut:
                return text, []
            done = completed_items(stripped)
            calls = [_checked(item, tools) for item in done]
            if done and all(c is not None for c in calls):
                return None, distinct([c for c in calls if c is not None])
            return (None if forced else text), []
        items = data if isinstance(data, list) else [data]
        calls = [_checked(item, tools) for item in items] if items else [None]
        if all(c is not None for c in calls):
            return None, distinct([c for c in calls if c is not None])
    if cut and forced and (not stripped or stripped.startswith("<tool_call>")):
        return None, []  # the grammar's opening of a call, cut before it closed
    return text, []


def distinct(calls: list[ToolCall]) -> list[ToolCall]:
    """The calls without repeats (same name, same arguments), first occurrence kept."""
    seen: set[str] = set()
    out = []
    for c in calls:
        if c.key not in seen:
            seen.add(c.key)
            out.append(c)
    return out


def completed_items(text: str) -> list[Any]:
    """The complete JSON values at the start of a JSON list cut short (``[{...}, {...}, {"na`` -> the first
    two); a single object cut short has none."""
    if not text.startswith("["):
        return []
    decoder = json.JSONDecoder()
    items: list[Any] = []
    pos = 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return items
        items.append(value)


def canonical(text: str, tools: Tools) -> str:
    """An answer that calls functions as one canonical JSON list of its calls (keys sorted; the fallback format,
    which `parse` reads back); any other answer unchanged."""
    _, calls = parse(text, tools)
    if not calls:
        return text
    return "[" + ", ".join(c.key for c in calls) + "]"


def _checked(item: Any, tools: Tools) -> ToolCall | None:
    if isinstance(item, str):
        try:
            item = json.loads(item)
        except json.JSONDecodeError:
            return None
    if not isinstance(item, dict) or set(item) != {"name", "arguments"}:
        return None
    fn = next((f for f in tools.functions if f["name"] == item["name"]), None)
    if fn is None or not isinstance(item["arguments"], dict):
        return None
    try:
        jsonschema.validate(item["arguments"], fn["parameters"])
    except jsonschema.ValidationError:
        return None
    return ToolCall(fn["name"], item["arguments"])
