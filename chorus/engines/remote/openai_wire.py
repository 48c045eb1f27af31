"""The OpenAI wire format of remote models: request bodies, responses and SSE chunks.

Pure functions, no I/O: `RemoteEngine` (``remote.py``) sends what `request_body` builds to a replica
(``replicas.py`` picks it and retries) and reads the answer with `generation_from` or `deltas_from`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterable, Callable
from typing import Any

from chorus.engines.core.base import (
    Choice,
    Constraint,
    Delta,
    Generation,
    GenerationRequest,
    TokenLogprob,
    TopLogprob,
)
from chorus.errors import EngineFailed, InvalidRequest


def request_body(
    req: GenerationRequest, stream: bool, *, model: str, upstream_model: str, api: str
) -> tuple[str, dict[str, Any]]:
    """The upstream path and JSON body for a request: ``/completions`` with the prompt as token ids
    (exactly what the gateway rendered), or ``/chat/completions`` with the messages (``api: chat``)."""
    p = req.params
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
    if p.logprobs:  # relayed: each token's logprob and its top alternatives, in the upstream API's own shape
        body.update({"logprobs": True, "top_logprobs": p.top_logprobs} if api == "chat"
                    else {"logprobs": p.top_logprobs})
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


#: a relayed token's id from its text (the gateway's tokenizer: `Vocab.first_id`; -1 when it has none)
TokenIds = Callable[[str], int]


def logprobs_from(lp: dict[str, Any] | None, ids: TokenIds, k: int) -> list[TokenLogprob] | None:
    """An upstream choice's logprobs (completions: ``tokens`` / ``token_logprobs`` / ``top_logprobs`` dicts; chat:
    ``content`` of ``{token, logprob, top_logprobs}``) -> chorus's, each with at most ``k`` alternatives, most
    likely first. None when the upstream sent none."""
    if not lp:
        return None
    out: list[TokenLogprob] = []
    if "content" in lp:  # chat
        for t in lp.get("content") or []:
            top = sorted(((a["token"], float(a["logprob"])) for a in t.get("top_logprobs") or []),
                         key=lambda a: -a[1])[:k]
            out.append(TokenLogprob(t["token"], ids(t["token"]), float(t["logprob"]),
                                    [TopLogprob(tok, v) for tok, v in top]))
        return out
    tops = lp.get("top_logprobs") or []
    for i, (token, value) in enumerate(zip(lp.get("tokens") or [], lp.get("token_logprobs") or [])):
        alts = sorted(((tok, float(v)) for tok, v in (tops[i] if i < len(tops) and tops[i] else {}).items()),
                      key=lambda a: -a[1])[:k]
        out.append(TokenLogprob(token, ids(token), float(value), [TopLogprob(tok, v) for tok, v in alts]))
    return out


def generation_from(data: dict[str, Any], prompt_tokens: int, ids: TokenIds | None = None,
                    k: int = 0) -> Generation:
    """A non-streamed completion or chat completion response -> a `Generation` (with ``ids``: its logprobs)."""
    choices = []
    for c in data.get("choices", []):
        text = c.get("text") if "text" in c else (c.get("message") or {}).get("content") or ""
        lps = logprobs_from(c.get("logprobs"), ids, k) if ids is not None else None
        choices.append(Choice(int(c.get("index", 0)), text, [lp.token_id for lp in lps] if lps else [],
                              c.get("finish_reason") or "stop", lps))
    usage = data.get("usage") or {}
    return Generation(choices, int(usage.get("prompt_tokens", prompt_tokens)),
                      int(usage.get("completion_tokens", 0)), cached_tokens(usage))


def cached_tokens(usage: dict[str, Any]) -> int:
    """The prompt tokens the upstream's prefix cache served, from an OpenAI usage object (0 when not said)."""
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def deltas_from(lines: AsyncIterable[bytes], model: str, request: GenerationRequest | None = None,
                      ids: TokenIds | None = None) -> AsyncGenerator[Delta, None]:
    """An SSE stream of completion or chat chunks (one line per item) -> `Delta`s (with ``ids``: their logprobs);
    an error event raises. The usage chunk's cached prompt tokens (the worker's prefix cache) go to
    ``request.cached_tokens``. One chunk is one token (vLLM and chorus send them so), except a choice's last: a
    token the server counts but sends no text for (an end-of-sequence token) shows only in the usage chunk, so
    each choice's last delta is held until the usage arrives and carries the tokens the count is short of."""
    k = request.params.top_logprobs if request is not None else 0
    held: list[Delta] = []  # each choice's last delta, until the usage chunk (or the end)
    counted = 0
    async for raw in lines:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            break
        event = json.loads(payload)
        if "error" in event:
            raise EngineFailed(f"{model}: upstream error: {event['error'].get('message', event['error'])}")
        usage = event.get("usage") or {}
        if request is not None and usage.get("prompt_tokens_details"):
            request.cached_tokens = cached_tokens(usage)
        if usage.get("completion_tokens") is not None and held:
            missing = int(usage["completion_tokens"]) - counted
            for i, d in enumerate(held):  # spread over the held choices, the first ones one more
                d.token_ids += [-1] * (missing // len(held) + (i < missing % len(held)))
        for c in event.get("choices") or []:
            text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content") or ""
            finish = c.get("finish_reason")
            lps = (logprobs_from(c.get("logprobs"), ids, k) or []) if ids is not None else []
            if text or finish or lps:
                tokens = [lp.token_id for lp in lps] if lps else [-1] if text else []
                counted += len(tokens)
                delta = Delta(int(c.get("index", 0)), text, tokens, lps, finish)
                if finish:
                    held.append(delta)
                else:
                    yield delta
    for d in held:
        yield d
