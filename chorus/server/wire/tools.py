"""OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` into the engine-neutral `Tools`
(engines/core/tool_calls.py renders, constrains and parses them), every malformed field a 400 naming it. (The
answer's calls are rendered by render.py's `assistant_message`.)"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema

from chorus.engines.core.base import Constraint, Tools
from chorus.errors import InvalidRequest

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
NO_PARAMETERS = {"type": "object", "properties": {}}


def tools_of(tools: list[Any] | None, choice: Any, parallel: bool | None,
             constraint: Constraint | None) -> Tools | None:
    """None when no call can happen (no tools, or ``tool_choice: none``)."""
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequest("'tool_choice' needs 'tools'.", param="tool_choice")
        return None
    functions, seen = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else t
            raise InvalidRequest(f"{where}: only tools of type 'function' are supported (got {kind!r}).",
                                 param=f"{where}.type")
        if not isinstance(t.get("function"), dict):
            raise InvalidRequest(f"{where}.function is missing: a tool of type 'function' needs a 'function' "
                                 "object with at least a 'name'.", param=f"{where}.function")
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise InvalidRequest(f"{where}.function.name must be 1-64 letters, digits, '_' or '-'.",
                                 param=f"{where}.function.name")
        if name in seen:
            raise InvalidRequest(f"{where}: the function name {name!r} is given twice.", param=f"{where}.function.name")
        seen.add(name)
        params = fn.get("parameters", NO_PARAMETERS)
        try:
            if not isinstance(params, dict):
                raise jsonschema.SchemaError("must be a JSON schema object")
            jsonschema.validators.validator_for(params).check_schema(params)
        except jsonschema.SchemaError as exc:
            raise InvalidRequest(f"{where}.function.parameters is not a valid JSON schema: {exc.message}",
                                 param=f"{where}.function.parameters") from None
        functions.append({"name": name, "description": str(fn.get("description") or ""), "parameters": params})
    mode = _choice(choice, seen)
    if mode is None:
        return None
    if constraint is not None:
        raise InvalidRequest("A response format and tools cannot both constrain one answer: send tool_choice "
                             "'none' with a response format, or no response format with tools.",
                             param="response_format")
    return Tools(json.dumps(functions), mode, True if parallel is None else parallel)


def _choice(choice: Any, names: set[str]) -> str | None:
    if choice is None or choice == "auto":
        return "auto"
    if choice == "none":
        return None
    if choice == "required":
        return "required"
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise InvalidRequest(f"tool_choice names the function {name!r}, which is not in 'tools'.",
                                 param="tool_choice")
        return str(name)
    raise InvalidRequest("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                         "{'name': ...}}.", param="tool_choice")
