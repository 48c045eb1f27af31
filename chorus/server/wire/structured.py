"""Structured-output request fields into a `Constraint`: OpenAI's ``response_format`` (chat) and vLLM's
``structured_outputs`` object (chat and completions; the form vLLM accepts since 0.12, when it removed the
older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` fields: those get a 400
that says what to send instead). Every malformed format is a 400 naming its field."""

from __future__ import annotations

import json
from typing import Any

from chorus.engines.core import constraint as grammars
from chorus.engines.core.base import Constraint
from chorus.errors import InvalidRequest

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
          "guided_whitespace_pattern")
#: the keys of ``structured_outputs`` chorus serves (vLLM's ``structural_tag`` and options are not)
SERVED = ("json", "json_object", "regex", "choice", "grammar")


def response_format(rf: Any) -> Constraint | None:
    """OpenAI's ``response_format``: ``text`` (None), ``json_object``, or ``json_schema``."""
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return _checked(Constraint("json_object", param="response_format"))
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
            raise InvalidRequest("response_format json_schema needs 'json_schema': {'name': ..., 'schema': {...}}.",
                                 param="response_format.json_schema")
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequest("response_format.json_schema.schema must be a JSON schema object.",
                                 param="response_format.json_schema.schema")
        return _checked(Constraint.json_schema(schema, param="response_format.json_schema.schema"))
    raise InvalidRequest(f"response_format type {kind!r} is not supported: use 'text', 'json_object' or "
                         "'json_schema'.", param="response_format")


def structured_outputs(raw: dict[str, Any]) -> Constraint | None:
    """vLLM's ``structured_outputs`` object (exactly one of json / json_object / regex / choice / grammar)."""
    for field in GUIDED:
        if raw.get(field) is not None:
            key = field.removeprefix("guided_")
            raise InvalidRequest(f"'{field}' was removed in vLLM 0.12 and chorus follows today's vLLM: send "
                                 f"'structured_outputs': {{'{key}': ...}} instead.", param=field)
    so = raw.get("structured_outputs")
    if so is None:
        return None
    param = "structured_outputs"
    if not isinstance(so, dict):
        raise InvalidRequest("'structured_outputs' must be an object, e.g. {'json': {...schema...}}.", param=param)
    unknown = sorted(set(so) - set(SERVED))
    if unknown:
        raise InvalidRequest(f"structured_outputs: {', '.join(unknown)} not supported; chorus serves "
                             f"{', '.join(SERVED)}.", param=f"{param}.{unknown[0]}")
    given = [k for k in SERVED if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise InvalidRequest(f"structured_outputs needs exactly one of {', '.join(SERVED)}; got "
                             f"{', '.join(given) or 'none'}.", param=param)
    key, value = given[0], so[given[0]]
    where = f"{param}.{key}"
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise InvalidRequest(f"{where}: not valid JSON: {exc}", param=where) from None
        if not isinstance(value, (dict, bool)):
            raise InvalidRequest(f"{where} must be a JSON schema.", param=where)
        return _checked(Constraint.json_schema(value, param=where))
    if key == "json_object":
        return _checked(Constraint("json_object", param=where))
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise InvalidRequest(f"{where} must be a non-empty list of non-empty strings.", param=where)
        return _checked(Constraint("choice", json.dumps(value), where))
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequest(f"{where} must be a non-empty string.", param=where)
    return _checked(Constraint(key, value, where))


def _checked(c: Constraint) -> Constraint:
    grammars.check(c)
    return c


def for_chat(raw: dict[str, Any], rf: Any) -> Constraint | None:
    a, b = response_format(rf), structured_outputs(raw)
    if a is not None and b is not None:
        raise InvalidRequest("Give either 'response_format' or 'structured_outputs', not both.",
                             param="structured_outputs")
    return a or b


def for_completion(raw: dict[str, Any]) -> Constraint | None:
    if raw.get("response_format") is not None:
        raise InvalidRequest("'response_format' is a chat completions field; on /v1/completions send "
                             "'structured_outputs' (vLLM's form).", param="response_format")
    return structured_outputs(raw)
