"""OpenAI's chat and completion request bodies; each converts itself into `GenerationRequest`s (how the
reply is rendered is render.py's)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from chorus.config import Limits
from chorus.engines.core.base import (
    INT_MAX,
    SEED_MAX,
    SEED_MIN,
    Constraint,
    Engine,
    GenerationRequest,
    SamplingParams,
    Tools,
)
from chorus.engines.core.generation import encode_prompt
from chorus.engines.core.request_scope import RequestScope
from chorus.engines.families.options import FamilyFields
from chorus.errors import InvalidRequest
from chorus.server.wire import fusion, structured, unsupported
from chorus.server.wire import tools as tool_fields


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
    top_k: int | None = Field(default=None, ge=-1, le=INT_MAX, description="extension (as vLLM): 0 or -1 = off")
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=INT_MAX)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    user: str | None = None
    ignore_eos: bool = Field(default=False, description="extension (as vLLM): keep going past EOS")
    cache_salt: str | None = Field(
        default=None, min_length=1, max_length=512,
        description="extension (as vLLM): a cached prompt prefix is reused only by requests with the same salt; "
                    "it narrows the key's own scope (keys never share prefixes unless server.prefix_cache.share "
                    "says so)")
    priority: int = Field(default=0, ge=0, le=INT_MAX, description="extension (as vLLM's field): 0 live (the default); above 0 "
                          "batch work, which the engines queue behind every live prompt (a gateway's remote "
                          "engine sends it with Batch API lines: remote.batch_priority)")
    ensemble: dict[str, Any] | None = Field(
        default=None, description="extension: run an ensemble strategy (ensembles/spec.py EnsembleSpec)")
    trace: bool = Field(default=False, description="extension: the model family's trace in the response "
                        "(MoE expert load, MoDr branch and steps per token, ReasonFormer skills and depth)")
    logit_bias: dict[str, float] | None = None  # token id -> bias in [-100, 100], as OpenAI
    #: structured outputs (server/wire/structured.py): ``response_format`` / ``structured_outputs``, parsed
    _constraint: Constraint | None = PrivateAttr(default=None)
    #: function calling (server/wire/tools.py; chat only)
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

    #: the GenAI semantic conventions' operation name (the request's span)
    operation: ClassVar[str] = "chat"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def completion_limit(self) -> int | None:
        """The most tokens the reply may have (chat: ``max_completion_tokens`` first)."""
        return self.max_tokens

    def check_limits(self, limits: Limits) -> None:
        """The server's request limits (``server.limits``): ``n``, ``max_tokens`` (chat: messages first)."""
        if self.n > limits.max_n:
            raise InvalidRequest(f"'n' must be at most {limits.max_n} on this server.", param="n")
        max_tokens = self.completion_limit
        if limits.max_tokens is not None and max_tokens is not None and max_tokens > limits.max_tokens:
            raise InvalidRequest(f"'max_tokens' must be at most {limits.max_tokens} on this server.",
                                 param="max_tokens")

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
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    response_format: Any = None  # text, json_object, json_schema (server/wire/structured.py)
    tools: list[Any] | None = None  # functions (server/wire/tools.py)
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

    def check_limits(self, limits: Limits) -> None:
        if len(self.messages) > limits.max_messages:
            raise InvalidRequest(f"At most {limits.max_messages} messages per request on this server.",
                                 param="messages")
        super().check_limits(limits)

    @property
    def completion_limit(self) -> int | None:
        """The completion's token limit (``max_completion_tokens``, else the older ``max_tokens``)."""
        return self.max_completion_tokens or self.max_tokens

    def sampling_params(self, defaults: dict[str, float] | None = None) -> SamplingParams:
        return self._params(self.completion_limit, self.logprobs, self.top_logprobs or 0, defaults or {})

    def to_generation_request(self, engine: Engine, scope: RequestScope | None = None) -> GenerationRequest:
        """This request for one engine: its chat template, its sampling defaults, the context checked. With
        ``continue_final_message`` the template renders the turns before the last one, and the assistant's partial
        answer follows the generation prompt as text (a sampled continuation of a partial sample is a sample of
        the whole answer)."""
        messages = self.message_dicts()
        params = self.sampling_params(engine.sampling_defaults)
        if not self.continue_final_message:
            return encode_prompt(engine, params, messages=messages, options=self.family_options,
                                 trace={} if self.trace else None, scope=scope)
        partial = engine.tokenizer.encode_text(str(messages[-1]["content"]))
        head = encode_prompt(engine, replace(params, max_tokens=1), messages=messages[:-1])
        whole = encode_prompt(engine, params, ids=head.prompt_ids + partial, label="the conversation",
                              options=self.family_options, trace={} if self.trace else None, scope=scope)
        return replace(whole, extra_stop=head.extra_stop)  # the template's stop strings still end the turn


class CompletionRequest(CompletionFields):
    operation: ClassVar[str] = "text_completion"
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0, le=INT_MAX)  # OpenAI's default; 0 with echo: score the prompt only
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

    def sampling_params(self, defaults: dict[str, float] | None = None) -> SamplingParams:
        return self._params(self.max_tokens, self.logprobs is not None, self.logprobs or 0, defaults or {})

    def to_generation_requests(self, engine: Engine, scope: RequestScope | None = None) -> list[GenerationRequest]:
        """One engine request per prompt (raw continuation: no chat template), each context-checked."""
        return [encode_prompt(engine, self.sampling_params(engine.sampling_defaults), label=f"prompt {i}",
                              options=self.family_options, trace={} if self.trace else None, scope=scope,
                              **({"text": p} if isinstance(p, str) else {"ids": p}))
                for i, p in enumerate(self.prompts())]
