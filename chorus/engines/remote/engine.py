"""A model served by OpenAI-compatible servers (vLLM, chorus worker, transformers serve), several replicas.

Replicas and retries live in ``replicas.py``, the OpenAI request / response format in
``openai_wire.py``; this module holds the engine, ``sessions.py`` its token-level sessions. `ReplicaPool` picks,
for each request, the healthy replica its routing policy ranks first (routing.py; by default the least loaded: a
load loop reads each replica's ``/metrics`` gauges every ``load_interval_s``); a replica that fails
(connection refused or reset, timeout, 5xx) is out for ``cooldown_s``, and a health loop (``/health``, else
``/v1/models``) brings it back. A request is retried on another replica as long
as nothing has been sent to the client; after the first streamed delta a failure is an error (the
gateway sends it as the stream's final error event, never a silent cut).

`RemoteEngine` keeps the model's tokenizer locally (for chat templates, context checks, token counts)
and talks to the servers with one pooled ``aiohttp.ClientSession`` (chosen by measurement: under 32
concurrent requests httpx's connection pool took 65% of the gateway's CPU; aiohttp serves 3.9x the
requests, see `chorus bench gateway`). ``api: completions`` sends the prompt as token ids to
``/v1/completions`` (exactly what the gateway rendered; vLLM and chorus accept ids),
``api: chat`` sends the messages to ``/v1/chat/completions`` (servers that only speak chat).
Upstream errors map into chorus's error tree. Token-level sessions (logit averaging): top-k logprobs
over ``/v1/completions`` (any server; approximate), or with ``token_api: chorus`` a chorus worker's
session API, which returns the exact logits (`WorkerSession`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import torch
from opentelemetry import propagate, trace

from chorus.engines.core import hub
from chorus.engines.core.base import (
    LOGITS,
    STREAM,
    STRUCTURED,
    TEXT,
    TOOLS,
    TOPK_LOGITS,
    Delta,
    Generation,
    GenerationRequest,
    TokenLogprob,
    TopLogprob,
    cancelled,
)
from chorus.engines.core.request_scope import UNSCOPED, RequestScope
from chorus.engines.core.scoring import by_prompt_logprobs
from chorus.engines.core.spec import ModelSpec
from chorus.engines.core.vocab import Vocab, vocab_of
from chorus.engines.remote.openai_wire import deltas_from, generation_from, request_body
from chorus.engines.remote.options import RemoteOptions
from chorus.engines.remote.replicas import Replica, ReplicaPool, Retryable, error_from, reported_load
from chorus.engines.remote.routing import Ask, ask_of
from chorus.engines.remote.sessions import RemoteSession, WorkerSession, sessions_url
from chorus.engines.runtime.metric import Metric
from chorus.errors import (
    CapabilityMismatch,
    EngineFailed,
    EngineUnavailable,
    InvalidRequest,
)

#: a span per replica attempt (a retry on the next replica is a sibling), parent of the replica's own request span
TRACER = trace.get_tracer("chorus.engines.remote")
log = logging.getLogger("chorus.remote")


class RemoteEngine:
    capabilities = frozenset({TEXT, STREAM, STRUCTURED})  # formats are sent on
    relays_logprobs = True  # a generation's token logprobs are relayed (openai_wire.logprobs_from)

    def __init__(self, spec: ModelSpec, tokenizer: Any) -> None:
        assert isinstance(spec.options, RemoteOptions)
        self.name = spec.name
        self.spec = spec
        self.remote: RemoteOptions = spec.options
        self.tokenizer = tokenizer
        self.max_model_len = spec.max_model_len or 4096
        self.sampling_defaults = spec.sampling_defaults.model_dump(exclude_none=True)
        self.pool = ReplicaPool(self.remote.replicas, self.remote.cooldown_s, self.remote.routing,
                                self.remote.affinity)
        self.upstream_model = self.remote.model or spec.name
        self._client: aiohttp.ClientSession | None = None
        self._health: asyncio.Task[None] | None = None
        self._load: asyncio.Task[None] | None = None
        caps = set(self.capabilities)
        if self.remote.api == "completions":  # the gateway renders tools into the prompt and parses the answer
            caps |= {TOPK_LOGITS, TOOLS}
        if self.remote.token_api == "chorus":  # a chorus worker's session API: exact next-token logits
            caps |= {TOPK_LOGITS, LOGITS}
        self.capabilities = frozenset(caps)
        self.sessions: set[WorkerSession] = set()
        self._closing: set[asyncio.Task[None]] = set()
        self._vocab: Vocab | None = None  # text -> token id, for remote top logprobs (built on first use)

    @classmethod
    def load(cls, spec: ModelSpec, models: dict[str, ModelSpec] | None = None) -> RemoteEngine:
        from transformers import AutoTokenizer

        from chorus.engines.core.hf_tokenizer import HFTokenizer

        assert isinstance(spec.options, RemoteOptions)
        ref = spec.options.tokenizer
        if hub.is_hub(ref):  # the hub's tokenizer files (fetched once into its cache)
            path = hub.fetch_snapshot(hub.parse(ref), spec.revision, hub.TOKENIZER_FILES)
        else:
            path = models[ref].checkpoint_dir() if models and ref in models else Path(ref).expanduser()
        if not Path(path).is_dir():
            raise EngineUnavailable(f"{spec.name}: tokenizer {ref!r} is neither a directory, a prepared model nor "
                                    "a hub repository (hf:ORG/REPO)")
        return cls(spec, HFTokenizer(AutoTokenizer.from_pretrained(str(path)), fallback=spec.fallback_chat))

    # ---- lifecycle ----

    async def start(self) -> None:
        r = self.remote
        key = os.environ.get(r.api_key_env, "") if r.api_key_env else ""
        self._client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=r.max_connections, ttl_dns_cache=60),
            timeout=aiohttp.ClientTimeout(total=None, connect=r.connect_timeout_s, sock_read=r.read_timeout_s),
            headers={"Authorization": f"Bearer {key}"} if key else {}, raise_for_status=False)
        self._health = asyncio.create_task(self._health_loop())
        if r.load_interval_s > 0:
            self._load = asyncio.create_task(self._load_loop())

    def close_later(self, replica: Replica, sid: str) -> None:
        """DELETE a worker session without making the caller wait (close() is synchronous)."""

        async def delete() -> None:
            try:
                await self.call(replica, "DELETE", f"{sessions_url(replica)}/{sid}")
            except Exception as exc:  # the worker's idle timeout frees it anyway
                log.info("closing session %s on %s failed: %s", sid, replica.url, exc)

        if self._client is None or self._client.closed:
            return
        task = asyncio.get_running_loop().create_task(delete())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        for session in list(self.sessions):
            session.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        await cancelled(self._health)
        await cancelled(self._load)
        if self._client is not None:
            await self._client.close()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.remote.health_interval_s)
            for r in self.pool.replicas:
                if r.healthy:
                    continue
                root = r.url.removesuffix("/v1")
                ok = False
                for url in (root + "/health", r.url + "/models"):
                    try:
                        async with self.client.get(url, timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
                            ok = resp.status == 200
                    except (aiohttp.ClientError, TimeoutError):
                        ok = False
                    if ok:
                        break
                if ok:
                    r.down_until = 0.0
                    log.info("replica %s is back", r.url)

    async def _load_loop(self) -> None:
        """Read every healthy replica's gauges (replicas.py, `reported_load`); a replica that exposes none, or
        stops answering, is left to what this gateway knows of it."""
        every = self.remote.load_interval_s
        model = self.remote.model or self.name
        while True:
            await asyncio.gather(*(self._read_load(r, model, every) for r in self.pool.replicas if r.healthy))
            await asyncio.sleep(every)

    async def _read_load(self, replica: Replica, model: str, every: float) -> None:
        try:
            url = replica.url.removesuffix("/v1") + "/metrics"
            async with self.client.get(url, timeout=aiohttp.ClientTimeout(total=max(every, 1.0))) as resp:
                text = await resp.text() if resp.status == 200 else ""
            replica.report(reported_load(text, model) if text else None, 3 * every)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("reading %s's load failed: %s", replica.url, exc)
            replica.report(None, 0.0)

    @property
    def client(self) -> aiohttp.ClientSession:
        if self._client is None:
            raise EngineUnavailable(f"{self.name}: the remote engine is not started")
        return self._client

    # ---- the Engine API ----

    def open_session(self, scope: RequestScope | None = None) -> RemoteSession | WorkerSession:
        if TOPK_LOGITS not in self.capabilities:
            raise CapabilityMismatch(f"{self.name} is served over a chat API: no token-level sessions.")
        if self.remote.token_api == "chorus":
            return WorkerSession(self, scope)
        return RemoteSession(self, scope)

    async def call(self, replica: Replica, method: str, url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """One JSON call to one replica (a span of its own, whose W3C ``traceparent`` the replica receives);
        errors mapped into chorus's tree, not retried."""
        with TRACER.start_as_current_span("remote.attempt", kind=trace.SpanKind.CLIENT,
                                          attributes={"server.address": replica.url, "http.request.method": method}):
            headers: dict[str, str] = {}
            propagate.inject(headers)
            async with self.client.request(method, url, json=body, headers=headers) as resp:
                text = await resp.text()
                trace.get_current_span().set_attribute("http.response.status_code", resp.status)
                if resp.status != 200:
                    raise error_from(resp.status, text, replica.url)
        return json.loads(text)

    async def next_token_logprobs(self, ids: list[int], scope: RequestScope) -> torch.Tensor:
        """The server's top-k next-token logprobs after ``ids``, as a vocabulary-sized tensor (-inf elsewhere)."""
        body = self.salted({"model": self.upstream_model, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                            "logprobs": self.remote.top_logprobs}, scope)
        data = await self._post("/completions", body, ask_of(ids, scope))
        top = ((data["choices"][0].get("logprobs") or {}).get("top_logprobs") or [{}])[0]
        if self._vocab is None:  # 262k strings for a large vocabulary: off the event loop, once
            await self.token_ids()
        vocab = self._vocab
        assert vocab is not None
        logits = torch.full((self.tokenizer.vocab_size,), float("-inf"))
        for text, lp in top.items():
            tid = vocab.first_id(text) if text else None
            if tid is None and text == "" and vocab.eos:
                tid = vocab.eos[0]  # special tokens (EOS) decode to ""
            if tid is not None and float(lp) > float(logits[tid]):
                logits[tid] = float(lp)
        return logits

    @property
    def active_sessions(self) -> int:
        return len(self.sessions)

    async def prompt_logprobs(self, ids: list[int], k: int,
                              scope: RequestScope | None = None) -> list[TokenLogprob | None]:
        """The server's prompt logprobs: ``/completions`` with the ids, ``echo`` and ``logprobs`` (vLLM and a
        chorus worker answer it; one token is generated and dropped). Needs ``api: completions``."""
        if self.remote.api != "completions":
            raise CapabilityMismatch(f"prompt logprobs need the remote model {self.name} served with "
                                     "api: completions (echo with logprobs).", param="echo")
        body = self.salted({"model": self.upstream_model, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                            "echo": True, "logprobs": max(k, 1)}, scope)
        data = await self._post("/completions", body, ask_of(ids, scope))
        lp = data["choices"][0].get("logprobs") or {}
        values, tops = lp.get("token_logprobs") or [], lp.get("top_logprobs") or []
        if len(values) < len(ids):
            raise EngineFailed(f"remote model {self.name}: the server returned {len(values)} prompt logprobs for "
                               f"{len(ids)} prompt tokens (does it support echo with logprobs?)")
        decode = self.tokenizer.decode
        out: list[TokenLogprob | None] = [None]
        for pos in range(1, len(ids)):
            top = sorted((tops[pos] or {}).items(), key=lambda kv: -kv[1])[:k] if pos < len(tops) else []
            out.append(TokenLogprob(decode([ids[pos]]), ids[pos], float(values[pos]),
                                    [TopLogprob(t, float(v)) for t, v in top]))
        return out

    async def score_continuations(self, prefix: list[int], continuations: list[list[int]],
                                  scope: RequestScope | None = None) -> list[list[float]]:
        """Each ``prefix + continuation`` scored whole by the server (one call per choice, concurrently)."""
        return await by_prompt_logprobs(self, prefix, continuations, scope)

    def placement(self) -> dict[str, Any]:
        """The model's servers (and its name there): where a remote member of an ensemble runs."""
        return {"runs": "remote", "upstream_model": self.upstream_model,
                "replicas": [r.url for r in self.pool.replicas]}

    def family_metrics(self) -> list[Metric]:
        return []  # a worker's own /metrics has its model family's counters

    def stats(self) -> dict[str, int]:
        return {"active_sessions": self.active_sessions, **self.pool.stats()}

    def _body(self, request: GenerationRequest, stream: bool) -> tuple[str, dict[str, Any]]:
        if request.options and not self.remote.family_options:
            name = sorted(request.options)[0]
            raise InvalidRequest(f"'{name}' cannot be sent to {self.name!r}: its servers do not take chorus's "
                                 "model-family fields (vLLM would ignore them; a chorus worker takes them with "
                                 "remote.family_options: true)", param=name)
        path, body = request_body(request, stream, model=self.name, upstream_model=self.upstream_model,
                                  api=self.remote.api)
        if self.remote.batch_priority is not None and request.scope.background:
            body["priority"] = self.remote.batch_priority  # batch work: behind the servers' live requests too
        return path, self.salted(body, request.scope)

    def salted(self, body: dict[str, Any], scope: RequestScope | None) -> dict[str, Any]:
        """``body`` with the request's prefix scope as ``cache_salt`` (`RequestScope.prefix_salt`: the tenant, narrowed by the
        client's own salt), so a worker's prefix cache keeps tenants apart as the gateway's would. vLLM and chorus
        workers take the field; ``remote.cache_salt: false`` leaves it out for servers that refuse it."""
        salt = (scope or UNSCOPED).prefix_salt
        if salt is not None and self.remote.cache_salt:
            body["cache_salt"] = salt
        return body

    async def generate(self, request: GenerationRequest) -> Generation:
        path, body = self._body(request, stream=False)
        ids = await self.token_ids() if request.params.logprobs else None
        gen = generation_from(await self._post(path, body, ask_of(request.prompt_ids, request.scope)), len(request.prompt_ids),
                              ids, request.params.top_logprobs)
        request.cached_tokens = gen.cached_tokens  # what the worker's prefix cache served (usage relays it)
        return gen

    async def _post(self, path: str, body: dict[str, Any], ask: Ask | None = None) -> dict[str, Any]:
        """One non-streamed call under the replicas' base URL (``/completions``, ...)."""
        return (await self.post_any(lambda r: r.url + path, body, ask))[1]

    async def post_any(self, url_of: Callable[[Replica], str], body: dict[str, Any],
                       ask: Ask | None = None) -> tuple[Replica, dict[str, Any]]:
        """POST to the replica the routing policy ranks first for ``ask`` (the prompt's ids, its scope), retried
        on the next one while replicas fail; returns the replica that answered and its JSON."""
        tried: set[str] = set()
        while True:
            replica = self.pool.pick(tried, ask)
            tried.add(replica.url)
            replica.outstanding += 1
            try:
                data = await self.call(replica, "POST", url_of(replica), body)
                self.pool.answered(replica)
                return replica, data
            except (aiohttp.ClientError, TimeoutError, Retryable) as exc:
                self.pool.failed(replica, f"{type(exc).__name__}: {exc}")
            finally:
                replica.outstanding -= 1

    async def token_ids(self) -> Callable[[str], int]:
        """A relayed token's id from its text (the servers send token strings): the gateway's own tokenizer."""
        if self._vocab is None:  # 262k strings for a large vocabulary: off the event loop, once
            self._vocab = await asyncio.to_thread(vocab_of, self.tokenizer)
        vocab = self._vocab

        def first(text: str) -> int:
            tid = vocab.first_id(text) if text else None
            return tid if tid is not None else (vocab.eos[0] if not text and vocab.eos else -1)

        return first

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[Delta, None]:
        path, body = self._body(request, stream=True)
        ids = await self.token_ids() if request.params.logprobs else None
        ask = ask_of(request.prompt_ids, request.scope)
        tried: set[str] = set()
        while True:
            replica = self.pool.pick(tried, ask)
            tried.add(replica.url)
            replica.outstanding += 1
            sent = False
            span = TRACER.start_span("remote.attempt", kind=trace.SpanKind.CLIENT,
                                     attributes={"server.address": replica.url, "http.request.method": "POST"})
            headers: dict[str, str] = {}
            propagate.inject(headers, context=trace.set_span_in_context(span))
            try:
                async with self.client.post(replica.url + path, json=body, headers=headers) as resp:
                    if resp.status != 200:
                        raise error_from(resp.status, await resp.text(errors="replace"), replica.url)
                    async for delta in deltas_from(resp.content, self.name, request, ids):
                        sent = True
                        yield delta
                self.pool.answered(replica)
                return
            except (aiohttp.ClientError, TimeoutError, Retryable) as exc:
                self.pool.failed(replica, f"{type(exc).__name__}: {exc}")
                span.set_status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}")
                if sent:
                    raise EngineFailed(f"{self.name}: replica {replica.url} failed mid-stream: {exc}") from exc
            finally:
                replica.outstanding -= 1
                span.end()
