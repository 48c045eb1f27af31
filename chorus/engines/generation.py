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

from chorus.engines import tool_calls
from chorus.engines.base import (
    LOGITS,
    STREAM,
    STRUCTURED,
    TEXT,
    TOOLS,
    Choice,
    Constraint,
    Delta,
    Engine,
    Generation,
    GenerationRequest,
    SamplingParams,
    Session,
    Tokenizer,
    TokenLogprob,
    TopLogprob,
)
from chorus.engines.constraint import Guide, ll_tokenizer
from chorus.engines.detokenize import TextAssembler
from chorus.engines.hf_tokenizer import has_tool_turns
from chorus.engines.runtime.metric import Metric
from chorus.engines.runtime.observer import DenseObserver, FamilyObserver
from chorus.engines.sampling import logprob_info, make_generator, sample
from chorus.engines.scoring import by_prompt_logprobs
from chorus.errors import ContextLengthExceeded, EngineFailed, GatewayError, InvalidRequest


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
                  options: dict[str, Any] | None = None, trace: dict[str, Any] | None = None) -> GenerationRequest:
    """The one place a prompt becomes an engine's request: chat messages through the engine's chat
    template (with the template's stop strings), text through its tokenizer, token ids checked against
    its vocabulary; then prompt + ``max_tokens`` against its context window. ``label`` names the prompt in
    errors (``prompt 2`` of a batch)."""
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
                             trace=trace)


class SessionEngine:
    """Text generation over token-level sessions; subclasses implement `open_session`."""

    name: str
    tokenizer: Tokenizer
    max_model_len: int
    capabilities = frozenset({TEXT, STREAM, LOGITS, STRUCTURED, TOOLS})
    sampling_defaults: dict[str, float] = {}  # noqa: RUF012 (each engine sets its own)

    def open_session(self) -> Session:  # pragma: no cover - abstract
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

    def check_options(self, options: dict[str, Any]) -> None:
        """Model-family options of a request (MoDr's ``recurrence``, ``exit``); plain models take none."""
        self.observer.check_options(options, self.name)

    def family_trace(self, sessions: list[Session]) -> dict[str, Any]:
        """What the model family observed for these sessions (a request's ``trace``)."""
        return self.observer.trace(sessions)

    async def prompt_logprobs(self, ids: list[int], k: int) -> list[TokenLogprob | None]:
        """Each prompt token's logprob given the tokens before it, with the top ``k`` alternatives (the
        first token has none): log-likelihood scoring, ``/v1/completions`` with ``echo`` and ``logprobs``.
        Generic and exact for any session engine (an ensemble's sessions give the mixture's logprobs): one
        session stepped through the prompt. Engines with a whole-prompt forward override it."""
        session = self.scoring_session()
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

    def scoring_session(self) -> Session:
        """The session prompt scoring steps (an engine whose sessions may not give its full distribution, such
        as a selective ensemble, returns one that does)."""
        return self.open_session()

    async def score_continuations(self, prefix: list[int], continuations: list[list[int]]) -> list[list[float]]:
        """Generic: each ``prefix + continuation`` scored whole; engines that can share the prefix override it."""
        return await by_prompt_logprobs(self, prefix, continuations)

    def family_metrics(self) -> list[Metric]:
        """The model family's counters since start-up (Prometheus)."""
        return self.observer.metrics()

    async def generate(self, request: GenerationRequest) -> Generation:
        choices = await collect(self.stream(request), request.params.logprobs)
        return Generation(choices, len(request.prompt_ids), sum(len(c.token_ids) for c in choices))

    async def prefill_sessions(self, prompt_ids: list[int], n: int,
                               options: dict[str, Any] | None = None) -> Sequence[tuple[Session, torch.Tensor]]:
        """Open ``n`` sessions on one prompt; engines that can share one prefill override this."""
        opened: list[Session] = []
        try:
            out = []
            for _ in range(n):
                session = self.open_session()
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
        try:
            started = await self.prefill_sessions(request.prompt_ids, params.n, request.options)
        except GatewayError:
            raise
        except Exception as exc:
            raise EngineFailed(f"{self.name}: prefill failed: {exc}") from exc
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
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for session, _ in started:
                session.close()
            if request.trace is not None:
                request.trace.update(self.family_trace([session for session, _ in started]))

    async def _run_choice(self, index: int, session: Session, logits: torch.Tensor, request: GenerationRequest,
                          max_tokens: int, queue: asyncio.Queue[Delta | BaseException | None]) -> None:
        try:
            params = request.params
            seed = None if params.seed is None else params.seed + index
            async for delta in decode_loop(session, logits, self.tokenizer, params, max_tokens, index,
                                           make_generator(seed), request.extra_stop):
                queue.put_nowait(delta)
            queue.put_nowait(None)
        except asyncio.CancelledError:
            raise
        except GatewayError as exc:
            queue.put_nowait(exc)
        except Exception as exc:  # an engine fault ends this request only
            queue.put_nowait(EngineFailed(f"{self.name}: generation failed: {exc}"))
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
                              ds[-1].finish_reason or "stop", lps))
    return choices


def token_logprob(tokenizer: Tokenizer, logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    lp, top = logprob_info(logits, token, k)
    return TokenLogprob(
        token=tokenizer.decode([token]), token_id=token, logprob=lp,
        top=[TopLogprob(tokenizer.decode([i]), v) for i, v in top],
    )


def biases(params: SamplingParams, logits: torch.Tensor) -> torch.Tensor | None:
    """``logit_bias`` as a vector over the logits (None without one); ids were checked by `encode_prompt`."""
    if not params.logit_bias:
        return None
    bias = torch.zeros(logits.shape[-1])
    for token, value in params.logit_bias:
        bias[token] = value
    return bias


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

    The last delta carries the finish reason: ``stop`` (EOS or a stop string) or ``length``.
    """
    assembler = TextAssembler(tokenizer.decode, tuple(params.stop) + tuple(extra_stop))
    counts: dict[int, int] = {}
    guide = await open_guide(params.constraint, tokenizer)
    bias = biases(params, logits)
    for produced in range(1, max_tokens + 1):
        if bias is not None:
            logits = logits.float() + bias
        if guide is not None:  # logprobs below: of the masked distribution the token is drawn from
            # the first mask of a grammar can take seconds (README, measured): off the event loop; later ones
            # take ~0.2 ms, inline, so the batch's rows submit their next tokens within the same step
            logits = guide.mask(logits) if produced > 1 else await asyncio.to_thread(guide.mask, logits)
        token = sample(logits, params, generator, counts)
        counts[token] = counts.get(token, 0) + 1
        lps = [token_logprob(tokenizer, logits, token, params.top_logprobs)] if params.logprobs else []
        if token in tokenizer.eos_token_ids and not (params.ignore_eos and guide is None):
            yield Delta(index, assembler.flush(), [token], lps, "stop")
            return
        if guide is not None:
            guide.accept(token)
        text = assembler.push(token)
        if assembler.stopped or (guide is not None and guide.stopped):  # complete: nothing may follow
            yield Delta(index, text + assembler.flush(), [token], lps, "stop")
            return
        if produced == max_tokens:
            yield Delta(index, text + assembler.flush(), [token], lps, "length")
            return
        yield Delta(index, text, [token], lps)
        logits = await session.step(token)
