"""The OpenAI wire format of remote models: request bodies, responses and SSE chunks.

Pure functions, no I/O: `RemoteEngine` (``remote.py``) sends what `request_body` builds to a replica
(``replicas.py`` picks it and retries) and reads the answer with `generation_from` or `deltas_from`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterable
from typing import Any

from chorus.engines.core.base import Choice, Constraint, Delta, Generation, GenerationRequest
from chorus.errors import EngineFailed, InvalidRequest


def request_body(
    req: GenerationRequest, stream: bool, *, model: str, upstream_model: str, api: str
) -> tuple[str, dict[str, Any]]:
    """The upstream path and JSON body for a request: ``/completions`` with the prompt as token ids
    (exactly what the gateway rendered), or ``/chat/completions`` with the messages (``api: chat``)."""
    p = req.params
    if p.logprobs:
        raise InvalidRequest(f"logprobs are not relayed from the remote model {model}.", param="logprobs")
    body: dict[str, Any] = {"model": upstream_model, "temperature": p.temperature, "top_p": p.top_p,
                            "n": p.n, "stream": stream, "presence_penalty": p.presence_penalty,
                            "frequency_penalty": p.frequency_penalty}
    if p.max_tokens is not None:
        body["max_tokens"] = p.max_tokens
    if p.seed is not None:
        body["seed"] = p.seed
    stop = list(p.stop) + list(req.extra_stop)
    if stop:
        body["stop"] = stop[:4]
    if p.top_k:
        body["top_k"] = p.top_k
    if p.ignore_eos:
        body["ignore_eos"] = True
    body.update(req.options)  # MoDr's recurrence / exit: a chorus worker serving a MoDr model checks them
    if p.constraint is not None:
        body.update(constraint_fields(p.constraint, api))
    if p.logit_bias:
        body["logit_bias"] = {str(t): b for t, b in p.logit_bias}
    if api == "chat":
        if p.tools is not None:
            raise InvalidRequest(f"{model} is served over a chat-only API, which chorus does not relay function "
                                 "calls through yet: use a completions upstream (api: completions).", param="tools")
        if req.messages is None:
            raise InvalidRequest(f"{model} is served over a chat-only API: use /v1/chat/completions.",
                                 param="prompt")
        return "/chat/completions", {**body, "messages": req.messages}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return "/completions", {**body, "prompt": req.prompt_ids}


def constraint_fields(c: Constraint, api: str) -> dict[str, Any]:
    """A structured-output constraint for the upstream server: on chat, JSON formats as OpenAI's own
    ``response_format`` (the widest understood); everything else as vLLM's ``structured_outputs`` (vLLM >= 0.12,
    chorus workers)."""
    if api == "chat" and c.kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if api == "chat" and c.kind == "json":
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": c.schema}}}
    return {"structured_outputs": c.wire()}


def generation_from(data: dict[str, Any], prompt_tokens: int) -> Generation:
    """A non-streamed completion or chat completion response -> a `Generation`."""
    choices = []
    for c in data.get("choices", []):
        text = c.get("text") if "text" in c else (c.get("message") or {}).get("content") or ""
        choices.append(Choice(int(c.get("index", 0)), text, [], c.get("finish_reason") or "stop", None))
    usage = data.get("usage") or {}
    return Generation(choices, int(usage.get("prompt_tokens", prompt_tokens)),
                      int(usage.get("completion_tokens", 0)), cached_tokens(usage))


def cached_tokens(usage: dict[str, Any]) -> int:
    """The prompt tokens the upstream's prefix cache served, from an OpenAI usage object (0 when not said)."""
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def deltas_from(lines: AsyncIterable[bytes], model: str,
                      request: GenerationRequest | None = None) -> AsyncGenerator[Delta, None]:
    """An SSE stream of completion or chat chunks (one line per item) -> `Delta`s; an error event raises. The
    usage chunk's cached prompt tokens (the worker's prefix cache) go to ``request.cached_tokens``."""
    async for raw in lines:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        event = json.loads(payload)
        if "error" in event:
            raise EngineFailed(f"{model}: upstream error: {event['error'].get('message', event['error'])}")
        usage = event.get("usage") or {}
        if request is not None and usage.get("prompt_tokens_details"):
            request.cached_tokens = cached_tokens(usage)
        for c in event.get("choices") or []:
            text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content") or ""
            finish = c.get("finish_reason")
            if text or finish:
                # one streamed chunk per token, as vLLM and chorus send them: the count is exact there
                yield Delta(int(c.get("index", 0)), text, [-1] if text else [], [], finish)
