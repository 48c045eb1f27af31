"""Engine-neutral request / result types and the Engine and Session protocols.

An engine turns a `GenerationRequest` into text (`generate`, `stream`) and, where it declares the
``"logits"`` capability, opens token-level `Session`s: ``prefill(ids)`` then ``step(token)``, each
returning next-token logits from the session's own KV cache, ``extend(ids)`` (several tokens in one
forward, the logits after each: speculative verification, a lagging member's catch-up),
``rollback(n)`` (forget the last n tokens: rejected proposals) and ``close()`` to free it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from chorus.engines.core.request_scope import UNSCOPED, RequestScope
from chorus.engines.runtime.metric import Metric
from chorus.errors import ContextLengthExceeded, EngineFailed, InvalidRequest

TEXT = "text"
STREAM = "stream"
LOGITS = "logits"
#: sessions whose logits hold only the top-k tokens (a remote server's top logprobs; -inf elsewhere)
TOPK_LOGITS = "topk_logits"
#: the output follows a response format (engines/core/constraint.py): every generating engine
STRUCTURED = "structured_outputs"
#: function calling (engines/core/tool_calls.py): tools in the prompt, calls parsed from the answer
TOOLS = "tools"
#: a multiple-choice scorer (engines/transformers/scorer.py): one logit per option, no text, no tokens
CHOICES = "choices"
#: an embedding model (engines/embedding/engine.py): vectors for /v1/embeddings, no text
EMBEDDINGS = "embeddings"

#: a request's ``seed`` (OpenAI's: a 64-bit signed integer); the wire refuses others with a 400 naming the field
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
#: the largest count a request may ask for (tokens, top_k, priority ...): a 400 above, never an overflow inside
INT_MAX = 2**31 - 1


@dataclass(frozen=True)
class Constraint:
    """An output format. ``spec``: the JSON schema as JSON text (``json``), the pattern (``regex``),
    the choices as a JSON list (``choice``), the grammar text (``grammar``), empty for ``json_object``.
    ``param`` names the request field it came from, for errors."""

    kind: str
    spec: str = ""
    param: str = "response_format"

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool, param: str = "response_format") -> Constraint:
        return cls("json", json.dumps(schema), param)  # key order kept: properties come out in it

    @property
    def schema(self) -> Any:
        """The JSON schema the output validates against (``json`` and ``json_object``), else None."""
        if self.kind == "json":
            return json.loads(self.spec)
        return {"type": "object"} if self.kind == "json_object" else None

    def wire(self) -> dict[str, Any]:
        """vLLM's ``structured_outputs`` object (vLLM >= 0.12, and chorus's own worker)."""
        if self.kind == "json":
            return {"json": json.loads(self.spec)}
        if self.kind == "json_object":
            return {"json_object": True}
        if self.kind == "choice":
            return {"choice": json.loads(self.spec)}
        return {self.kind: self.spec}


@dataclass(frozen=True)
class Tools:
    """Functions the model may call (OpenAI ``tools``; engines/core/tool_calls.py): ``spec`` holds the functions as
    JSON text (``name``, ``description``, ``parameters``); ``choice`` is ``auto``, ``required`` or the name of
    the one function to call; ``parallel``: more than one call per answer."""

    spec: str
    choice: str = "auto"
    parallel: bool = True

    @property
    def functions(self) -> list[dict[str, Any]]:
        return list(json.loads(self.spec))

    def as_openai(self) -> list[dict[str, Any]]:
        """The ``tools`` list as chat templates read it."""
        return [{"type": "function", "function": f} for f in self.functions]


@dataclass(frozen=True)
class SamplingParams:
    """What the sampler does with next-token logits. ``temperature == 0`` (or below 1e-5) means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    max_tokens: int | None = None  # None: up to the context window
    stop: tuple[str, ...] = ()
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    #: structured outputs: the output follows this format (engines/core/constraint.py); None: free text
    constraint: Constraint | None = None
    #: functions the model may call; the chat prompt offers them and the answer is parsed for calls
    tools: Tools | None = None
    #: OpenAI ``logit_bias``: (token id, bias) pairs added to the logits before sampling
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5  # tinier temperatures overflow logits / T: the same as greedy


@dataclass
class GenerationRequest:
    """A tokenized prompt plus sampling parameters; the protocol models build it."""

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""
    extra_stop: tuple[str, ...] = ()  # stop strings the engine adds (fallback chat template)
    #: the chat messages the prompt was rendered from (engines that speak chat to a server send these)
    messages: list[dict[str, Any]] | None = None
    #: model-family options (MoDr: ``recurrence``, ``exit``); engines refuse options they do not know
    options: dict[str, Any] = field(default_factory=dict)
    #: when not None, the engine fills it with what the model family observed (expert load, MoDr routing)
    trace: dict[str, Any] | None = None
    #: set by the engine at prefill: prompt tokens read from its prefix cache (usage's ``cached_tokens``)
    cached_tokens: int = 0
    #: what the request carries to the engine beside its parameters (tenant, salt, routing key, priority, deadline)
    scope: RequestScope = UNSCOPED


@dataclass
class TopLogprob:
    token: str
    logprob: float

    @property
    def bytes(self) -> list[int]:
        return list(self.token.encode("utf-8"))


@dataclass
class TokenLogprob:
    token: str
    token_id: int
    logprob: float
    top: list[TopLogprob] = field(default_factory=list)

    @property
    def bytes(self) -> list[int]:
        return list(self.token.encode("utf-8"))


@dataclass
class Delta:
    """A piece of one choice's output, as streamed."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop: str | None = None  #: with finish_reason "stop": the stop string that ended it (None: EOS)


@dataclass
class Choice:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None
    stop: str | None = None  #: the stop string that ended it (None: EOS, the limit, or a strategy's choice)


@dataclass
class Generation:
    choices: list[Choice]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  #: prompt tokens read from the engine's prefix cache


@runtime_checkable
class Tokenizer(Protocol):
    eos_token_ids: frozenset[int]

    def __hash__(self) -> int: ...  # vocabularies are cached per tokenizer

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_text(self, text: str) -> list[int]: ...  # no special tokens

    def token_strings(self) -> list[str]: ...  # each id's text ("" for special tokens)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str: ...

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """``tools``: OpenAI tool objects, for tokenizers whose template takes them (``supports_tools``)."""
        ...

    @property
    def supports_tools(self) -> bool: ...  # the chat template renders tools, tool calls and tool results

    @property
    def vocab_size(self) -> int: ...

    @property
    def fingerprint(self) -> str: ...

    @property
    def chat_stop(self) -> tuple[str, ...]: ...


@runtime_checkable
class Session(Protocol):
    """One sequence with its own KV cache. Logits are 1-D float32 tensors over the vocabulary."""

    @property
    def length(self) -> int: ...

    async def prefill(self, ids: Sequence[int]) -> torch.Tensor: ...

    async def step(self, token: int) -> torch.Tensor: ...

    async def extend(self, ids: Sequence[int]) -> torch.Tensor:
        """Feed several tokens at once: (len(ids), V), row j the logits after ``ids[j]``."""
        ...

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` tokens (0 <= n < length): the cache is as if they were never fed."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class DrivenSession(Session, Protocol):
    """A session that can run a plain choice (no grammar) by itself: ``drive`` takes the prefill's logits and
    a `picks.TokenPicker` and yields its `picks.Pick`s, sampling wherever the engine finds it cheapest (the
    llama.cpp engine: on its decode thread, between decodes), token for token what stepping would give."""

    def drive(self, logits: torch.Tensor, picker: Any) -> AsyncGenerator[Any, None]: ...


@runtime_checkable
class ChoiceScorer(Protocol):
    """A model that scores a prompt's options directly (engines/transformers/scorer.py), with no tokens or text."""

    name: str
    #: what the scorer is (family, head, ...), for ``/v1/models``
    description: dict[str, Any]

    async def score_options(self, prompt: str, options: Sequence[str]) -> tuple[list[float], int]:
        """One logit per option, and the tokens read."""
        ...


def check_extend(closed: bool, prefilled: bool, n: int, length: int, max_model_len: int) -> None:
    """What a session's ``extend`` needs: open, prefilled, at least one token, and room in the context window."""
    if closed:
        raise EngineFailed("session is closed")
    if not prefilled:
        raise InvalidRequest("prefill the session before stepping it")
    if not n:
        raise InvalidRequest("extend needs at least one token")
    if length + n > max_model_len:
        raise ContextLengthExceeded(f"session exceeds the context window of {max_model_len} tokens")


def check_can_roll_back(closed: bool, prefilled: bool, running: bool) -> None:
    """A rollback needs an open, prefilled session that is not in a forward."""
    if closed or not prefilled:
        raise InvalidRequest("rollback needs an open, prefilled session")
    if running:
        raise InvalidRequest("rollback while the session is running a forward")


def check_rollback(n: int, length: int) -> None:
    """A session may forget 0..length-1 of its tokens (never its whole prompt)."""
    if not 0 <= n < length:
        raise InvalidRequest(f"cannot roll back {n} of {length} tokens")


@dataclass
class ServerLoad:
    """What an endpoint picker reads of a model server (the inference gateway's model-server protocol): an engine
    with a batch of its own reports it (``server_load()``), a worker's ``/metrics`` exposes it."""

    waiting: int  #: requests queued, not yet in the batch
    running: int  #: sequences in the batch
    kv_usage: float  #: share of the batch's KV capacity in use, 0..1 (prefix-cache entries, evictable, not counted)


#: the inference gateway's model-server protocol, under vLLM's names (what endpoint pickers read out of the box) and
#: chorus's own: (vLLM name, chorus name, help, the `ServerLoad` field). A worker's /metrics writes them
#: (server/gateway/metrics.py); a remote model's pool reads them back (engines/remote/replicas.py)
SERVER_LOAD = (
    ("vllm:num_requests_waiting", "chorus_num_requests_waiting", "requests queued, not yet in the batch", "waiting"),
    ("vllm:num_requests_running", "chorus_num_requests_running", "sequences in the batch", "running"),
    ("vllm:kv_cache_usage_perc", "chorus_kv_cache_usage_perc", "share of the KV capacity in use (1 = full)", "kv_usage"),
    ("vllm:gpu_cache_usage_perc", None, "share of the KV capacity in use (vLLM's older name)", "kv_usage"),
)


async def cancelled(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` (None: nothing) and wait until it has ended, its ``finally`` blocks run."""
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def gather_ready(count_ready: Callable[[], int], total: int, window_s: float, wake: asyncio.Event) -> None:
    """A batching scheduler's pause before its next step: give the ``total`` sequences it just served a moment
    to submit their next token, so they share one step instead of splitting it. Waits up to ``window_s`` after
    the last one that did (rows that mask their logits for a grammar take a few tenths of a millisecond each
    on the event loop: a fixed window split a batch of 8 into two forwards), at most 8 windows in all;
    ``count_ready()`` says how many have (or have gone). ``wake`` is the scheduler's event, set whenever a
    sequence submits work: the pause sleeps on it rather than polling (a poll every half millisecond cost a
    single stream up to that much per token), and clears it (the scheduler plans from its queues after)."""
    if total == 0:
        return
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + window_s
    ready = count_ready()
    while ready < total:
        left = min(deadline, start + 8 * window_s) - loop.time()
        if left <= 0:
            break
        wake.clear()
        try:
            async with asyncio.timeout(left):
                await wake.wait()
        except TimeoutError:
            break
        now_ready = count_ready()
        if now_ready > ready:
            ready, deadline = now_ready, loop.time() + window_s


@runtime_checkable
class Engine(Protocol):
    name: str
    capabilities: frozenset[str]
    tokenizer: Tokenizer
    max_model_len: int
    #: temperature / top_p / top_k for requests that leave them out
    sampling_defaults: dict[str, float]

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    def open_session(self, scope: RequestScope | None = None) -> Session: ...

    async def generate(self, request: GenerationRequest) -> Generation: ...

    def stream(self, request: GenerationRequest) -> AsyncGenerator[Delta, None]: ...

    @property
    def active_sessions(self) -> int: ...

    def stats(self) -> dict[str, int]: ...

    def family_metrics(self) -> list[Metric]:
        """A model family's counters since start-up, for Prometheus (MoE expert load, MoDr branches)."""
        ...

    def placement(self) -> dict[str, Any]:
        """Where the model runs, for an ensemble's trace: ``{"runs": "in-process"}``, or a remote model's servers."""
        ...

    async def prompt_logprobs(self, ids: list[int], k: int,
                              scope: RequestScope | None = None) -> list[TokenLogprob | None]:
        """Each prompt token's logprob given the ones before it (None for the first), top ``k`` alternatives."""
        ...

    async def score_continuations(self, prefix: list[int], continuations: list[list[int]],
                                  scope: RequestScope | None = None) -> list[list[float]]:
        """For each continuation, the logprob of each of its tokens after ``prefix`` and the tokens before it
        (multiple-choice scoring, ``engines/core/scoring.py``)."""
        ...
