"""OpenAI request and response models; requests convert themselves into `GenerationRequest`s."""

from __future__ import annotations

import secrets
import time
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from chorus.engines.core.base import (
    Choice,
    Constraint,
    Delta,
    Engine,
    Generation,
    GenerationRequest,
    SamplingParams,
    TokenLogprob,
    Tools,
)
from chorus.engines.core.generation import encode_prompt
from chorus.engines.families.options import FamilyFields
from chorus.errors import InvalidRequest
from chorus.server import fusion, structured, unsupported
from chorus.server import tools as tool_fields


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class CompletionFields(FamilyFields):
    """Fields shared by chat and text completions, the model families' request fields among them (declared by each
    family: `FamilyFields`). Unknown fields are ignored, as OpenAI-compatible servers do."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, description="extension (as vLLM): 0 or -1 = off")
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = None
    user: str | None = None
    ignore_eos: bool = Field(default=False, description="extension (as vLLM): keep going past EOS")
    cache_salt: str | None = Field(
        default=None, min_length=1, max_length=512,
        description="extension (as vLLM): a cached prompt prefix is reused only by requests with the same salt; "
                    "it narrows the key's own scope (keys never share prefixes unless server.prefix_cache.share "
                    "says so)")
    ensemble: dict[str, Any] | None = Field(
        default=None, description="extension: run an ensemble strategy (ensembles/spec.py EnsembleSpec)")
    trace: bool = Field(default=False, description="extension: the model family's trace in the response "
                        "(MoE expert load, MoDr branch and steps per token, ReasonFormer skills and depth)")
    logit_bias: dict[str, float] | None = None  # token id -> bias in [-100, 100], as OpenAI
    #: structured outputs (server/structured.py): ``response_format`` / ``structured_outputs``, parsed
    _constraint: Constraint | None = PrivateAttr(default=None)
    #: function calling (server/tools.py; chat only)
    _tools: Tools | None = PrivateAttr(default=None)

    @model_validator(mode="wrap")
    @classmethod
    def _unsupported(cls, data: Any, handler: Any) -> Any:
        body = handler(data)
        raw = data if isinstance(data, dict) else {}
        body.refuse_unsupported(raw)
        body.ensemble = fusion.ensemble_of(raw.get("plugins"), body.ensemble)
        body._constraint = body.read_constraint(raw)
        body._tools = body.read_tools()
        return body

    def refuse_unsupported(self, raw: dict[str, Any]) -> None:
        """400 for the fields this server does not serve (``raw``: the body as sent, undeclared fields too)."""
        return None

    def read_constraint(self, raw: dict[str, Any]) -> Constraint | None:
        return structured.for_completion(raw)

    def read_tools(self) -> Tools | None:
        return None

    @property
    def constraint(self) -> Constraint | None:
        return self._constraint

    @property
    def tool_set(self) -> Tools | None:
        return self._tools

    @model_validator(mode="after")
    def _stream_options(self) -> CompletionFields:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (v or {}).items():
            if not key.strip().isdigit():
                raise ValueError(f"keys are token ids (integers as strings); got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"biases are between -100 and 100; got {value} for token {key}")
        return v

    @property
    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _params(self, max_tokens: int | None, logprobs: bool, top_logprobs: int,
                defaults: dict[str, float]) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        top_k = self.top_k if self.top_k is not None else defaults.get("top_k", 0)
        return SamplingParams(
            temperature=self.temperature if self.temperature is not None else defaults.get("temperature", 1.0),
            top_p=self.top_p if self.top_p is not None else defaults.get("top_p", 1.0),
            top_k=max(int(top_k), 0),
            seed=self.seed,
            max_tokens=max_tokens,
            stop=stop,
            n=self.n,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            ignore_eos=self.ignore_eos,
            constraint=self._constraint,
            tools=self._tools,
            logit_bias=self.bias_pairs,
        )


class ChatCompletionRequest(CompletionFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    response_format: Any = None  # text, json_object, json_schema (server/structured.py)
    tools: list[Any] | None = None  # functions (server/tools.py)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    continue_final_message: bool = Field(
        default=False, description="extension (as vLLM): the last message is the assistant's partial answer; the "
                                   "model continues it (its text is the prompt's end, not a finished turn)")

    def refuse_unsupported(self, raw: dict[str, Any]) -> None:
        unsupported.check_chat(raw, self)

    def read_constraint(self, raw: dict[str, Any]) -> Constraint | None:
        return structured.for_chat(raw, self.response_format)

    def read_tools(self) -> Tools | None:
        return tool_fields.tools_of(self.tools, self.tool_choice, self.parallel_tool_calls, self._constraint)

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
        if self.continue_final_message:
            last = self.messages[-1]
            if last.role != "assistant" or not isinstance(last.content, str) or not last.content:
                raise InvalidRequest("'continue_final_message' continues the last message: it must be the "
                                     "assistant's partial answer, as a non-empty string.",
                                     param="continue_final_message")
            if self.tools:  # (on an ensemble, named or inline: refused by the route, which resolves it)
                raise InvalidRequest("'continue_final_message' is served without tools.",
                                     param="continue_final_message")
        return self

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]

    @property
    def completion_limit(self) -> int | None:
        """The completion's token limit (``max_completion_tokens``, else the older ``max_tokens``)."""
        return self.max_completion_tokens or self.max_tokens

    def sampling_params(self, defaults: dict[str, float] | None = None) -> SamplingParams:
        return self._params(self.completion_limit, self.logprobs, self.top_logprobs or 0, defaults or {})

    def to_generation_request(self, engine: Engine) -> GenerationRequest:
        """This request for one engine: its chat template, its sampling defaults, the context checked. With
        ``continue_final_message`` the template renders the turns before the last one, and the assistant's partial
        answer follows the generation prompt as text (a sampled continuation of a partial sample is a sample of
        the whole answer)."""
        messages = self.message_dicts()
        params = self.sampling_params(engine.sampling_defaults)
        if not self.continue_final_message:
            return encode_prompt(engine, params, messages=messages, options=self.family_options,
                                 trace={} if self.trace else None)
        partial = engine.tokenizer.encode_text(str(messages[-1]["content"]))
        head = encode_prompt(engine, replace(params, max_tokens=1), messages=messages[:-1])
        whole = encode_prompt(engine, params, ids=head.prompt_ids + partial, label="the conversation",
                              options=self.family_options, trace={} if self.trace else None)
        return replace(whole, extra_stop=head.extra_stop)  # the template's stop strings still end the turn


class CompletionRequest(CompletionFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)  # OpenAI's default; 0 with echo: score the prompt only
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.suffix:
            raise InvalidRequest("'suffix' (fill-in-the-middle) is not supported.", param="suffix")
        if isinstance(self.prompt, list) and not self.prompt:
            raise InvalidRequest("'prompt' must not be empty.", param="prompt")
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequest("'max_tokens' 0 generates nothing: it needs 'echo': true (score the prompt).",
                                 param="max_tokens")
        return self

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (a string, or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    @property
    def completion_limit(self) -> int | None:
        return self.max_tokens

    def sampling_params(self, defaults: dict[str, float] | None = None) -> SamplingParams:
        return self._params(self.max_tokens, self.logprobs is not None, self.logprobs or 0, defaults or {})

    def to_generation_requests(self, engine: Engine) -> list[GenerationRequest]:
        """One engine request per prompt (raw continuation: no chat template), each context-checked."""
        return [encode_prompt(engine, self.sampling_params(engine.sampling_defaults), label=f"prompt {i}",
                              options=self.family_options, trace={} if self.trace else None,
                              **({"text": p} if isinstance(p, str) else {"ids": p}))
                for i, p in enumerate(self.prompts())]


# ---- responses ----

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens`` (chat and completions): prompt tokens the engine's prefix cache
    served, as ``prompt_tokens_details.cached_tokens``."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def chat_logprobs(lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if lps is None:
        return None
    return {"content": [
        {"token": lp.token, "logprob": lp.logprob, "bytes": lp.bytes,
         "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in lp.top]}
        for lp in lps], "refusal": None}


def completion_logprobs(lps: list[TokenLogprob] | None, offset: int = 0) -> dict[str, Any] | None:
    if lps is None:
        return None
    offsets, pos = [], offset
    for lp in lps:
        offsets.append(pos)
        pos += len(lp.token)
    return {"tokens": [lp.token for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{t.token: t.logprob for t in lp.top} for lp in lps], "text_offset": offsets}


def prompt_logprobs(tokens: list[str], lps: list[TokenLogprob | None]) -> dict[str, Any]:
    """The echoed prompt's logprobs as vLLM returns them: every prompt token, ``null`` for the first."""
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob if lp is not None else None for lp in lps],
            "top_logprobs": [{t.token: t.logprob for t in lp.top} if lp is not None else None for lp in lps],
            "text_offset": offsets}


def joined_logprobs(prompt: dict[str, Any] | None, completion: dict[str, Any] | None) -> dict[str, Any] | None:
    """An echoed prompt's logprobs followed by the completion's (offsets already continue the echo)."""
    if prompt is None or completion is None:
        return completion if prompt is None else prompt
    return {k: prompt[k] + completion[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


class ResponseHead:
    """id / created / model / system_fingerprint, the same on every chunk of one response."""

    def __init__(self, prefix: str, model: str, fingerprint: str) -> None:
        self.id = new_id(prefix)
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint

    def base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}


def chat_response(head: ResponseHead, gen: Generation, offered: Tools | None = None) -> dict[str, Any]:
    """``offered``: the functions the model could call; a choice that calls them gets ``tool_calls``."""
    def choice(c: Choice) -> dict[str, Any]:
        message, finish = tool_fields.message(c.text, c.finish_reason, offered)
        out = {"index": c.index, "message": message, "logprobs": chat_logprobs(c.logprobs), "finish_reason": finish}
        return {**out, "stop_reason": c.stop} if c.stop is not None and finish == "stop" else out

    return {**head.base("chat.completion"), "choices": [choice(c) for c in gen.choices],
            "usage": usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)}


def chat_chunk(head: ResponseHead, delta: Delta | None, *, index: int = 0,
               logprobs: bool = False) -> dict[str, Any]:
    if delta is None:  # the opening chunk that carries the role
        body: dict[str, Any] = {"role": "assistant", "content": ""}
        ch = {"index": index, "delta": body, "logprobs": None, "finish_reason": None}
    else:
        body = {"content": delta.text} if delta.text or not delta.finish_reason else {}
        ch = {"index": delta.index, "delta": body,
              "logprobs": chat_logprobs(delta.logprobs) if logprobs else None,
              "finish_reason": delta.finish_reason}
        if delta.stop is not None:
            ch["stop_reason"] = delta.stop  # vLLM's field: the stop string that ended the choice
    return {**head.base("chat.completion.chunk"), "choices": [ch]}


def chat_tool_chunks(head: ResponseHead, deltas: list[Delta], offered: Tools, logprobs: bool) -> list[dict[str, Any]]:
    """One choice's chunks when functions were offered: its whole text is parsed first, then sent as
    ``tool_calls`` (each call whole in one delta, as OpenAI's last argument chunk completes it) or as content."""
    index, finish = deltas[-1].index, deltas[-1].finish_reason or "stop"
    text = "".join(d.text for d in deltas)
    message, finish = tool_fields.message(text, finish, offered)
    lps = chat_logprobs([lp for d in deltas for lp in d.logprobs]) if logprobs else None
    delta: dict[str, Any] = {"content": message["content"]} if message["content"] else {}
    if "tool_calls" in message:
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
    base = head.base("chat.completion.chunk")
    last: dict[str, Any] = {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}
    if deltas[-1].stop is not None and finish == "stop":
        last["stop_reason"] = deltas[-1].stop
    return [{**base, "choices": [{"index": index, "delta": delta, "logprobs": lps, "finish_reason": None}]},
            {**base, "choices": [last]}]


def completion_response(head: ResponseHead, choices: list[dict[str, Any]], prompt_tokens: int,
                        completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {**head.base("text_completion"), "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
