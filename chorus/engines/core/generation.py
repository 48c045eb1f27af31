"""The decode loop shared by every engine that can open token-level sessions.

`SessionEngine` implements `generate()` and `stream()` on top of `open_session()`: one session per
choice, sampling on the session's logits, stop strings, logprobs, finish reasons. Subclasses only
provide sessions and a tokenizer (the transformers engine, the fake engine).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from dataclasses import replace
from typing import Any

import torch
from opentelemetry import trace

from chorus.engines.core import tool_calls
from chorus.engines.core.base import (
    LOGITS,
    STREAM,
    STRUCTURED,
    TEXT,
    TOOLS,
    Choice,
    Constraint,
    Delta,
    DrivenSession,
    Engine,
    Generation,
    GenerationRequest,
    SamplingParams,
    Session,
    Tokenizer,
    TokenLogprob,
)
from chorus.engines.core.constraint import Guide, ll_tokenizer
from chorus.engines.core.detokenize import TextAssembler
from chorus.engines.core.hf_tokenizer import has_tool_turns
from chorus.engines.core.picks import TokenPicker, stepped_picks, token_logprob
from chorus.engines.core.request_scope import UNSCOPED, RequestScope
from chorus.engines.core.sampling import make_generator
from chorus.engines.core.scoring import by_prompt_logprobs
from chorus.engines.runtime.metric import Metric
from chorus.engines.runtime.observer import DenseObserver, FamilyObserver
from chorus.errors import ContextLengthExceeded, EngineFailed, GatewayError, InvalidRequest

#: engine phases as spans (OpenTelemetry's API: no-ops unless the server configured the SDK)
TRACER = trace.get_tracer("chorus.engines")


def check_context(prompt_len: int, params: SamplingParams, max_model_len: int) -> int:
    """Validate prompt + max_tokens against the context window; return the effective max_tokens."""
    if prompt_len == 0:
        raise InvalidRequest("The prompt is empty.", param="prompt")
    room = max_model_len - prompt_len
    wanted = params.max_tokens if params.max_tokens is not None else room
    if room <= 0 or wanted > room:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + wanted} tokens ({prompt_len} in the messages, {wanted} in the completion). "
            "Please reduce the length of the messages or completion.",
            param="messages" if params.max_tokens is None else "max_tokens",
        )
    return wanted


def encode_prompt(engine: Engine, params: SamplingParams, *, messages: list[dict[str, Any]] | None = None,
                  text: str | None = None, ids: list[int] | None = None, label: str = "the prompt",
                  options: dict[str, Any] | None = None, trace: dict[str, Any] | None = None,
                  scope: RequestScope | None = None) -> GenerationRequest:
    """The one place a prompt becomes an engine's request: chat messages through the engine's chat
    template (with the template's stop strings), text through its tokenizer, token ids checked against
    its vocabulary; then prompt + ``max_tokens`` against its context window. ``label`` names the prompt in
    errors (``prompt 2`` of a batch). ``scope``: what the request carries to the engine (`RequestScope`)."""
    tok = engine.tokenizer
    extra_stop: tuple[str, ...] = ()
    if messages is not None:
        native = tok.supports_tools
        if params.tools is not None or has_tool_turns(messages):
            messages = tool_calls.prepare(messages, params.tools, native)
        offered = params.tools.as_openai() if native and params.tools is not None else None
        ids, extra_stop = tok.encode_chat(messages, offered), tok.chat_stop
        if params.tools is not None:
            tags = tool_calls.tag_terms(tok) if native else tool_calls.TEXT_TAGS
            params = replace(params, constraint=tool_calls.constraint(params.tools, native, tags) or params.constraint)
    elif text is not None:
        ids = tok.encode(text)
    elif ids is None:
        raise InvalidRequest("The prompt is empty.", param="prompt")
    elif any(t < 0 or t >= tok.vocab_size for t in ids):
        raise InvalidRequest(f"{label} holds token ids outside the vocabulary (0..{tok.vocab_size - 1}).",
                             param="prompt")
    check_context(len(ids), params, engine.max_model_len)
    outside = [t for t, _ in params.logit_bias if not 0 <= t < tok.vocab_size]
    if outside:
        raise InvalidRequest(f"logit_bias names token id(s) {', '.join(map(str, outside[:5]))} outside the "
                             f"vocabulary of {engine.name} (0..{tok.vocab_size - 1}).", param="logit_bias")
    return GenerationRequest(list(ids), params, extra_stop=extra_stop, messages=messages, options=options or {},
                             trace=trace, scope=scope or UNSCOPED)


class SessionEngine:
    """Text generation over token-level sessions; subclasses implement `open_session`."""

    name: str
    tokenizer: Tokenizer
    max_model_len: int
    capabilities = frozenset({TEXT, STREAM, LOGITS, STRUCTURED, TOOLS})
    sampling_defaults: dict[str, float] = {}  # noqa: RUF012 (each engine sets its own)

    def open_session(self, scope: RequestScope | None = None) -> Session:  # pragma: no cover - abstract
        raise NotImplementedError

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    @property
    def active_sessions(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def stats(self) -> dict[str, int]:
        return {"active_sessions": self.active_sessions}

    #: the model family's hooks (MoE expert load, MoDr routing and options); a plain model's by default
    observer: FamilyObserver = DenseObserver()

    def placement(self) -> dict[str, Any]:
        return {"runs": "in-process"}

    def check_options(self, options: dict[str, Any]) -> None:
        """Model-family options of a request (MoDr's ``recurrence``, ``exit``); plain models take none."""
        self.observer.check_options(options, self.name)

    def family_trace(self, sessions: list[Session]) -> dict[str, Any]:
        """What the model family observed for these sessions (a request's ``trace``)."""
        return self.observer.trace(sessions)

    async def prompt_logprobs(self, ids: list[int], k: int,
                              scope: RequestScope | None = None) -> list[TokenLogprob | None]:
        """Each prompt token's logprob given the tokens before it, with the top ``k`` alternatives (the
        first token has none): log-likelihood scoring, ``/v1/completions`` with ``echo`` and ``logprobs``.
        Generic and exact for any session engine (an ensemble's sessions give the mixture's logprobs): one
        session stepped through the prompt. Engines with a whole-prompt forward override it."""
        session = self.scoring_session(scope)
        try:
            logits = await session.prefill(ids[:1])
            out: list[TokenLogprob | None] = [None]
            for i, token in enumerate(ids[1:], start=1):
                out.append(token_logprob(self.tokenizer, logits, token, k))
                if i < len(ids) - 1:
                    logits = await session.step(token)
            return out
        finally:
            session.close()

    def scoring_session(self, scope: RequestScope | None = None) -> Session:
        """The session prompt scoring steps (an engine whose sessions may not give its full distribution, such
        as a selective ensemble, returns one that does)."""
        return self.open_session(scope)

    async def score_continuations(self, prefix: list[int], continuations: list[list[int]],
                                  scope: RequestScope | None = None) -> list[list[float]]:
        """Generic: each ``prefix + continuation`` scored whole; engines that can share the prefix override it."""
        return await by_prompt_logprobs(self, prefix, continuations, scope)

    def family_metrics(self) -> list[Metric]:
        """The model family's counters since start-up (Prometheus)."""
        return self.observer.metrics()

    async def generate(self, request: GenerationRequest) -> Generation:
        choices = await collect(self.stream(request), request.params.logprobs)
        return Generation(choices, len(request.prompt_ids), sum(len(c.token_ids) for c in choices),
                          request.cached_tokens)

    async def prefill_sessions(self, prompt_ids: list[int], n: int, options: dict[str, Any] | None = None,
                               scope: RequestScope | None = None) -> Sequence[tuple[Session, torch.Tensor]]:
        """Open ``n`` sessions on one prompt; engines that can share one prefill override this."""
        opened: list[Session] = []
        try:
            out = []
            for _ in range(n):
                session = self.open_session(scope)
                opened.append(session)
                out.append((session, await session.prefill(prompt_ids)))
            return out
        except BaseException:
            for session in opened:
                session.close()
            raise

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[Delta, None]:
        params = request.params
        max_tokens = check_context(len(request.prompt_ids), params, self.max_model_len)
        self.check_options(request.options)
        queue: asyncio.Queue[Delta | BaseException | None] = asyncio.Queue()
        # engine phases as spans (no-ops unless tracing is configured): the wait for the batch and the prefill, then
        # the decode of every choice
        with TRACER.start_as_current_span("engine.prefill", attributes={
                "chorus.engine": self.name, "gen_ai.usage.input_tokens": len(request.prompt_ids), "chorus.n": params.n}
                ) as prefill_span:
            try:
                started = await self.prefill_sessions(request.prompt_ids, params.n, request.options, request.scope)
            except GatewayError:
                raise
            except Exception as exc:
                raise EngineFailed(f"{self.name}: prefill failed: {exc}") from exc
            # a prefix cache's hit (the engine's sessions say how many prompt tokens they did not compute)
            request.cached_tokens = max((getattr(s, "cached", 0) for s, _ in started), default=0)
            prefill_span.set_attribute("chorus.cached_tokens", request.cached_tokens)
            queue_span(prefill_span, started)
        decode_span = TRACER.start_span("engine.decode", attributes={"chorus.engine": self.name})
        emitted = 0
        if len(started) == 1:  # one choice: decoded in the consumer's task (no task and queue between them)
            session, logits = started[0]
            try:
                async for delta in self._choice(0, session, logits, request, max_tokens):
                    emitted += len(delta.token_ids)
                    yield delta
            finally:
                session.close()
                if request.trace is not None:
                    request.trace.update(self.family_trace([session]))
                decode_span.set_attribute("gen_ai.usage.output_tokens", emitted)
                decode_span.end()
            return
        tasks = [
            asyncio.create_task(self._run_choice(i, session, logits, request, max_tokens, queue))
            for i, (session, logits) in enumerate(started)
        ]
        finished = 0
        try:
            while finished < len(tasks):
                item = await queue.get()
                if item is None:
                    finished += 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    emitted += len(item.token_ids)
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for session, _ in started:
                session.close()
            if request.trace is not None:
                request.trace.update(self.family_trace([session for session, _ in started]))
            decode_span.set_attribute("gen_ai.usage.output_tokens", emitted)
            decode_span.end()

    async def _choice(self, index: int, session: Session, logits: torch.Tensor, request: GenerationRequest,
                      max_tokens: int) -> AsyncGenerator[Delta, None]:
        """One choice's deltas; an engine fault (not a request error) becomes this engine's `EngineFailed`."""
        params = request.params
        seed = None if params.seed is None else params.seed + index
        deltas = decode_loop(session, logits, self.tokenizer, params, max_tokens, index, make_generator(seed),
                             request.extra_stop)
        try:
            async for delta in deltas:
                yield delta
        except GatewayError:
            raise
        except Exception as exc:  # an engine fault ends this request only
            raise EngineFailed(f"{self.name}: generation failed: {exc}") from exc
        finally:
            await deltas.aclose()

    async def _run_choice(self, index: int, session: Session, logits: torch.Tensor, request: GenerationRequest,
                          max_tokens: int, queue: asyncio.Queue[Delta | BaseException | None]) -> None:
        try:
            async for delta in self._choice(index, session, logits, request, max_tokens):
                queue.put_nowait(delta)
            queue.put_nowait(None)
        except asyncio.CancelledError:
            raise
        except GatewayError as exc:
            queue.put_nowait(exc)
        finally:
            session.close()


async def collect(deltas: AsyncGenerator[Delta, None], logprobs: bool) -> list[Choice]:
    """Gather a stream of deltas into whole choices, by index."""
    parts: dict[int, list[Delta]] = {}
    async for delta in deltas:
        parts.setdefault(delta.index, []).append(delta)
    choices = []
    for index in sorted(parts):
        ds = parts[index]
        lps = [lp for d in ds for lp in d.logprobs] if logprobs else None
        choices.append(Choice(index, "".join(d.text for d in ds), [t for d in ds for t in d.token_ids],
                              ds[-1].finish_reason or "stop", lps, ds[-1].stop))
    return choices


async def open_guide(constraint: Constraint | None, tokenizer: Tokenizer) -> Guide | None:
    """A row's grammar matcher (None without a constraint). The first one on a tokenizer builds llguidance's
    view of the vocabulary (seconds on a 262k vocabulary): off the event loop."""
    if constraint is None:
        return None
    await asyncio.to_thread(ll_tokenizer, tokenizer)
    return Guide(constraint, tokenizer)


async def decode_loop(session: Session, logits: torch.Tensor, tokenizer: Tokenizer, params: SamplingParams,
                      max_tokens: int, index: int, generator: torch.Generator,
                      extra_stop: tuple[str, ...] = ()) -> AsyncGenerator[Delta, None]:
    """Sample up to ``max_tokens`` tokens from a prefilled session, yielding text deltas.

    The tokens come from a `TokenPicker` (picks.py), through the session's own driver when it has one
    (`DrivenSession`: the llama.cpp engine samples on its decode thread) and `stepped_picks` otherwise; this
    half turns them into text, holding back what may be a stop string. The last delta carries the finish
    reason: ``stop`` (EOS, a stop string, a complete grammar) or ``length``.
    """
    assembler = TextAssembler(tokenizer.decode, tuple(params.stop) + tuple(extra_stop))
    guide = await open_guide(params.constraint, tokenizer)
    picker = TokenPicker(tokenizer, params, generator, max_tokens, guide)
    picks = (session.drive(logits, picker) if guide is None and isinstance(session, DrivenSession)
             else stepped_picks(session, logits, picker))
    try:
        async for pick in picks:
            if pick.eos:
                yield Delta(index, assembler.flush(), [pick.token], pick.logprobs, "stop")
                return
            text = assembler.push(pick.token)
            if assembler.stopped:  # a stop string: nothing may follow
                yield Delta(index, text + assembler.flush(), [pick.token], pick.logprobs, "stop",
                            assembler.stopped_by)
                return
            if pick.final:
                yield Delta(index, text + assembler.flush(), [pick.token], pick.logprobs, pick.final)
                return
            yield Delta(index, text, [pick.token], pick.logprobs)
    finally:
        await picks.aclose()


def queue_span(prefill: Any, started: Sequence[tuple[Any, Any]]) -> None:
    """The wait before a prefill's first forward, as a child span of ``engine.prefill`` (from its start to when the
    scheduler first took the prompt: the sessions' ``scheduled_ns``, set by the engines that batch)."""
    scheduled = [t for t in (getattr(s, "scheduled_ns", None) for s, _ in started) if t]
    begin = getattr(prefill, "start_time", None)
    if not scheduled or not begin:  # no batch scheduler, or tracing off (a no-op span has no start time)
        return
    TRACER.start_span("engine.queue", start_time=begin).end(end_time=max(begin, min(scheduled)))
