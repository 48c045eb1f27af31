"""What a strategy gets for one request: its resolved members, the client's prompt, and the `Call` that makes
member requests and keeps their usage, failures and trace."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from opentelemetry.trace import StatusCode

from chorus.engines.core.base import Delta, Engine, Generation, GenerationRequest, SamplingParams
from chorus.engines.core.generation import encode_prompt
from chorus.engines.core.request_scope import UNSCOPED, RequestScope
from chorus.ensembles import spans
from chorus.ensembles.metrics import MEMBER_CALLS
from chorus.ensembles.spec import MemberSpec
from chorus.errors import GatewayError, InvalidRequest, MemberFailed

T = TypeVar("T")


@dataclass
class Member:
    """A resolved member: its spec, its engine and its label in the trace."""

    index: int
    label: str
    spec: MemberSpec
    engine: Engine

    def persona(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages with this member's system prompt in place of the request's (if it has one)."""
        if self.spec.system is None:
            return messages
        rest = [m for m in messages if m.get("role") not in ("system", "developer")]
        return [{"role": "system", "content": self.spec.system}, *rest]


def with_own_sampling(members: Sequence[Member]) -> list[str]:
    """The labels of members that set their own temperature, top_p or seed."""
    return [m.label for m in members
            if m.spec.temperature is not None or m.spec.top_p is not None or m.spec.seed is not None]


def resolve_members(specs: Sequence[MemberSpec], engines: dict[str, Engine]) -> list[Member]:
    missing = sorted({s.model for s in specs if s.model not in engines})
    if missing:
        # the models themselves are not listed here: a key with an allow-list sees its own in GET /v1/models
        raise InvalidRequest(f"Unknown ensemble member(s): {', '.join(missing)}; GET /v1/models lists the models "
                             "you may use.", param="ensemble.members")
    counts: dict[str, int] = {}
    members = []
    for i, s in enumerate(specs):
        base = s.name or s.model
        counts[base] = counts.get(base, 0) + 1
        label = base if counts[base] == 1 else f"{base}#{counts[base]}"
        members.append(Member(i, label, s, engines[s.model]))
    return members


@dataclass
class Prompt:
    """What the client asked: chat messages, or a raw text prompt (/v1/completions)."""

    messages: list[dict[str, Any]] | None = None
    text: str | None = None

    def as_messages(self) -> list[dict[str, Any]]:
        return self.messages if self.messages is not None else [{"role": "user", "content": self.text or ""}]

    @property
    def question(self) -> str:
        """The last user message's text (or the raw prompt): what text-level strategies discuss."""
        for m in reversed(self.as_messages()):
            if m.get("role") == "user":
                return content_text(m.get("content"))
        return ""


def content_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def replace_question(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """The messages with the last user message's content replaced by ``text``."""
    out = [dict(m) for m in messages]
    for m in reversed(out):
        if m.get("role") == "user":
            m["content"] = text
            return out
    return [*out, {"role": "user", "content": text}]


class Said(Protocol):
    """An answer as the reply gives it (an answer-side strategy's sample)."""

    @property
    def text(self) -> str: ...

    @property
    def finish_reason(self) -> str | None: ...


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    calls: int = 0
    cached_tokens: int = 0  #: prompt tokens the members' prefix caches served

    def add(self, prompt: int, completion: int, calls: int = 1, cached: int = 0) -> None:
        self.prompt_tokens += prompt
        self.completion_tokens += completion
        self.calls += calls
        self.cached_tokens += cached

    def as_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens, "calls": self.calls,
                "cached_tokens": self.cached_tokens}


@dataclass
class Call:
    """One ensemble request: the prompt, the client's sampling, and what the members used and said.

    ``sampling(defaults)`` builds the client's `SamplingParams` with a member engine's defaults for the
    fields the client left out; members' own temperature / top_p / seed and a strategy's overrides go
    on top. ``usage`` sums every member call; ``trace`` is returned to clients that ask for it.
    """

    members: list[Member]
    prompt: Prompt
    sampling: Callable[[dict[str, float]], SamplingParams]
    on_member_error: str
    logprobs: bool = False
    ensemble: str = ""  # the named ensemble (metrics)
    usage: Usage = field(default_factory=Usage)
    trace: dict[str, Any] = field(default_factory=dict)
    #: whether the client asked for the trace: what only the trace shows (per-token agreement) is computed then
    detail: bool = True
    by_member: dict[str, Usage] = field(default_factory=dict)
    #: the served model behind each label in ``by_member`` (members, and callers beyond them: an aggregator, a judge)
    model_of: dict[str, str] = field(default_factory=dict)
    #: every member request made, in order (benchmarks replay them one by one)
    requests: list[tuple[Member, GenerationRequest]] = field(default_factory=list)
    #: the choices the client asked for (token-level strategies and those with ``answers_n``)
    n: int = 1
    #: the request's bounds (`EnsembleSpec`): seconds from the start, completion tokens of every member call
    deadline_s: float | None = None
    max_total_tokens: int | None = None
    started: float = field(default_factory=time.monotonic)
    stopped: str | None = None  # why the budget ended the work early (None: it did not)
    #: what an online router decided (kept with the request id, so that feedback can be joined to it)
    decision: dict[str, Any] | None = None
    #: what the request carries to the engines (tenant, salt, routing key, priority): every member call's
    scope: RequestScope = UNSCOPED

    def over_budget(self, before: str) -> bool:
        """Whether the deadline or the token budget is spent, so that ``before`` (a new round, the judge, ...)
        must not start; the first such stop is recorded for the trace."""
        if self.deadline_s is not None and time.monotonic() - self.started >= self.deadline_s:
            why = f"deadline of {self.deadline_s:g} s"
        elif self.max_total_tokens is not None and self.usage.completion_tokens >= self.max_total_tokens:
            why = f"token budget of {self.max_total_tokens}"
        else:
            return False
        if self.stopped is None:
            self.stopped = f"{why} reached before {before}"
        return True

    def request(self, member: Member, messages: list[dict[str, Any]] | None = None, *, persona: bool = True,
                instruction: str | None = None, **overrides: Any) -> GenerationRequest:
        """The member's generation request: its chat template (or the raw prompt), persona and sampling.

        ``persona=False``: the caller already put the member's system prompt into ``messages``. ``instruction``:
        appended to the client's question (a blank line between; the raw prompt becomes a user message).
        """
        if instruction is not None:
            asked = f"{self.prompt.question}\n\n{instruction}"
            messages = replace_question(messages or self.prompt.as_messages(), asked)
        own = {k: v for k, v in (("temperature", member.spec.temperature), ("top_p", member.spec.top_p),
                                 ("seed", member.spec.seed)) if v is not None}
        params = replace(self.sampling(member.engine.sampling_defaults), **{**own, **overrides})
        if messages is None and self.prompt.text is not None:
            return encode_prompt(member.engine, params, text=self.prompt.text, scope=self.scope)
        msgs = messages if messages is not None else self.prompt.as_messages()
        return encode_prompt(member.engine, params, messages=member.persona(msgs) if persona else msgs,
                             scope=self.scope)

    def record(self, member: Member, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> None:
        self.usage.add(prompt_tokens, completion_tokens, cached=cached_tokens)
        self.by_member.setdefault(member.label, Usage()).add(prompt_tokens, completion_tokens, cached=cached_tokens)
        self.model_of[member.label] = member.spec.model

    async def generate(self, member: Member, messages: list[dict[str, Any]] | None = None, *, persona: bool = True,
                       instruction: str | None = None, **overrides: Any) -> Generation | None:
        """One member call. A failure raises `MemberFailed` (``fail``) or is noted in the trace (``skip``: None)."""
        req = self.request(member, messages, persona=persona, instruction=instruction, **overrides)
        self.requests.append((member, req))
        span = spans.member_call(self.scope, self.ensemble, member.label, member.spec.model, req.params.max_tokens,
                                 req.params.temperature)
        try:
            with spans.within(span):  # the engine's phases are its children
                gen = await member.engine.generate(req)
            spans.usage(span, gen.prompt_tokens, gen.completion_tokens)
        except InvalidRequest as exc:
            span.record_exception(exc)
            raise
        except Exception as exc:
            span.record_exception(exc)
            span.set_status(StatusCode.ERROR, message(exc))
            self.member_failed(member, exc)
            return None
        finally:
            span.end()
        MEMBER_CALLS.labels(self.ensemble, member.label, "ok").inc()
        self.record(member, gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)
        return gen

    async def stream(self, member: Member, messages: list[dict[str, Any]] | None = None, *, persona: bool = True,
                     instruction: str | None = None, **overrides: Any) -> AsyncGenerator[Delta, None]:
        """A member's output as it is made (for strategies that stream a member's answer, e.g. an aggregator)."""
        req = self.request(member, messages, persona=persona, instruction=instruction, **overrides)
        self.requests.append((member, req))
        completion = 0
        span = spans.member_call(self.scope, self.ensemble, member.label, member.spec.model, req.params.max_tokens,
                                 req.params.temperature)
        stream = spans.under(span, member.engine.stream(req))  # the engine's phases are its children
        try:
            async for d in stream:
                completion += len(d.token_ids)
                yield d
        except (InvalidRequest, MemberFailed):
            raise
        except Exception as exc:
            MEMBER_CALLS.labels(self.ensemble, member.label, "failed").inc()
            span.set_status(StatusCode.ERROR, message(exc))
            raise MemberFailed(f"ensemble member {member.label!r} ({member.spec.model}) failed: {message(exc)}",
                               param="ensemble.members") from exc
        finally:
            await stream.aclose()
            self.record(member, len(req.prompt_ids), completion, req.cached_tokens)
            spans.usage(span, len(req.prompt_ids), completion)
            span.end()

    def member_failed(self, member: Member, exc: BaseException) -> None:
        MEMBER_CALLS.labels(self.ensemble, member.label, "failed").inc()
        if self.on_member_error == "fail":
            raise MemberFailed(f"ensemble member {member.label!r} ({member.spec.model}) failed: {message(exc)}",
                               param="ensemble.members") from exc
        self.trace.setdefault("errors", []).append({"member": member.label, "error": message(exc)})

    def survivors(self, results: Sequence[T | None], members: Sequence[Member]) -> list[tuple[Member, T]]:
        alive = [(m, r) for m, r in zip(members, results) if r is not None]
        if not alive:
            raise MemberFailed("every ensemble member failed: " + "; ".join(
                f"{e['member']}: {e['error']}" for e in self.trace.get("errors", [])), param="ensemble.members")
        return alive

    def reply(self, ranked: Sequence[Said]) -> list[Delta]:
        """The reply: the first ``n`` of the ranked answers (an answer-side strategy's samples, best first); a 400
        naming ``n`` when fewer were drawn."""
        if len(ranked) < self.n:
            raise InvalidRequest(f"n={self.n} but only {len(ranked)} samples were drawn; raise 'samples'.", param="n")
        return [Delta(i, s.text, finish_reason=s.finish_reason) for i, s in enumerate(ranked[:self.n])]

    def final_trace(self) -> dict[str, Any]:
        budget = {"deadline_s": self.deadline_s, "max_total_tokens": self.max_total_tokens,
                  "elapsed_s": round(time.monotonic() - self.started, 3), "stopped": self.stopped}
        return {**self.trace, "usage_by_member": {k: u.as_dict() for k, u in self.by_member.items()},
                "usage": self.usage.as_dict(), "budget": budget}


def message(exc: BaseException) -> str:
    return exc.message if isinstance(exc, GatewayError) else f"{type(exc).__name__}: {exc}"


async def gather(*aws: Awaitable[T]) -> list[T]:
    """``asyncio.gather`` that cancels the siblings when one fails (member calls never outlive a request)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
