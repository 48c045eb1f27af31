"""Continuous batching over a Hugging Face causal LM: the scheduler.

Every open sequence (a `BatchedSession`) is one row of a single batched KV cache (`batch_rows.BatchRows`). Each
scheduler iteration runs, on one forward thread (`forward_passes.ForwardPasses`):

1. one decode forward for every row that has a token waiting (rows without one get a masked padding
   column, so sequences join, idle and leave between steps without disturbing the others), and
2. prefill work of at most ``prefill_chunk`` tokens (`prefill_plan.plan_prefills`): either several waiting
   prompts together in one right-padded forward (a burst of requests gets its first tokens at once), or one
   chunk of a prompt longer than that (chunked prefill: a long prompt delays the running sequences by one
   chunk per step, not by its whole length).

A finished prefill joins the batch (``n`` copies for ``n`` choices share one prefill); closed rows leave at the
next iteration. Masks (4-D boolean, with the sliding window computed on real positions, `attention_masks`) and
position ids are built by chorus, so padding never shifts a row's positions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from chorus.engines.core.base import cancelled, check_can_roll_back, check_extend, check_rollback, gather_ready
from chorus.engines.core.request_scope import UNSCOPED, RequestScope, queue_in
from chorus.engines.runtime.kv_cache import GrowingCache
from chorus.engines.runtime.observer import DenseObserver, FamilyObserver
from chorus.engines.transformers.batch_rows import BatchRows, PrefillJob, resolve
from chorus.engines.transformers.forward_passes import ForwardPasses
from chorus.engines.transformers.prefill_plan import plan_prefills
from chorus.engines.transformers.prefix_store import PrefixStore
from chorus.errors import ContextLengthExceeded, EngineFailed, EngineUnavailable, InvalidRequest

log = logging.getLogger("chorus.batching")
T = TypeVar("T")
#: most tokens one row feeds in one decode forward (a longer `extend` takes several; the other rows pay
#: padding columns up to this width, never a whole catch-up's)
MAX_EXTEND = 16


class BatchedSession:
    """One sequence (one row of the batch); the `Session` protocol over a `BatchRunner`."""

    def __init__(self, runner: BatchRunner, options: dict[str, Any] | None = None,
                 scope: RequestScope | None = None) -> None:
        self._runner = runner
        self.scope = scope or UNSCOPED  # its request's: the prefix cache's salt, live or batch work
        #: model-family options of the request (MoDr: recurrence, exit) and what the family observed
        self.options: dict[str, Any] = options or {}
        self.family: Any = None
        self.length = 0  # real tokens in the cache
        self.pending: list[int] | None = None  # tokens waiting for the next decode forward(s)
        self.received: list[torch.Tensor] = []  # logits of the pending tokens fed so far (B, V) rows
        self.dropping = 0  # tokens rolled back, applied to the batch mask before the next forward
        self.future: asyncio.Future[torch.Tensor] | None = None
        self.joined = False
        self.closed = False
        self.cached = 0  # prompt tokens its prefill read from the prefix cache
        self.scheduled_ns: int | None = None  # when its prefill first entered a forward (the queue span's end)
        runner.sessions.add(self)

    async def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        if self.joined or self.future is not None:
            raise InvalidRequest("session is already prefilled")
        return await self._runner.submit_prefill([self], list(ids))

    async def step(self, token: int) -> torch.Tensor:
        return (await self.extend([token]))[-1]

    async def extend(self, ids: Sequence[int]) -> torch.Tensor:
        """Several tokens in the batch's decode forwards (up to `MAX_EXTEND` a forward): (len(ids), V)."""
        check_extend(self.closed, self.joined, len(ids), self.length, self._runner.max_model_len)
        loop = asyncio.get_running_loop()
        self.future = loop.create_future()
        self.pending = [int(t) for t in ids]
        self.received = []
        self._runner.wake()
        try:
            return await self.future
        finally:
            self.future = None
            self.received = []

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` tokens: their cache columns are masked out before the next forward (and
        trimmed once no row uses them), so nothing attends to them again."""
        check_can_roll_back(self.closed, self.joined, self.future is not None)
        check_rollback(n, self.length)
        self.length -= n
        self.dropping += n

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pending = None
            self._runner.sessions.discard(self)
            self._runner.wake()



class BatchRunner:
    """Schedules the batch: admits prefills, gathers the rows that have a token waiting, runs one step at a
    time on the forward thread and hands each session its logits."""

    def __init__(
        self,
        model: Any,
        *,
        max_model_len: int,
        max_batch_size: int = 16,
        prefill_chunk: int = 512,
        gather_wait_s: float = 0.004,
        observer: FamilyObserver | None = None,
        prefix: PrefixStore | None = None,
    ) -> None:
        self.model = model
        #: the model family's hooks around every forward (dense: none)
        self.observer = observer if observer is not None else DenseObserver()
        self.passes = ForwardPasses(model, self.observer)
        self.device = self.passes.device
        self.max_model_len = max_model_len
        self.max_batch_size = max_batch_size
        self.prefill_chunk = prefill_chunk
        self.gather_wait_s = gather_wait_s
        self.sliding_window = self.passes.masks.sliding_window
        self.sessions: set[BatchedSession] = set()
        self.batch = BatchRows(self.device, self.observer)
        self.prefills: deque[PrefillJob] = deque()
        #: finished prompts' keys and values for reuse (off: budget 0, or a family that cannot reuse them)
        self.prefix = prefix if prefix is not None and self.observer.reuses_prefixes else PrefixStore(0)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._last_delivered: list[BatchedSession] = []
        self.steps = 0
        # One dedicated thread runs every forward: torch's OpenMP team stays bound to it, instead of
        # each pool thread spinning up its own team that competes for the same cores.
        self._executor: ThreadPoolExecutor | None = None

    @property
    def rows(self) -> list[BatchedSession]:
        return self.batch.rows

    @property
    def cache(self) -> GrowingCache | None:
        return self.batch.cache

    @property
    def mask(self) -> torch.Tensor | None:
        """(B, T): 1 where a row has a real token."""
        return self.batch.mask

    # ---- API used by sessions (event-loop thread) ----
    def wake(self) -> None:
        self._wake.set()

    def start(self) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chorus-forward")
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="chorus-batch-runner")

    async def stop(self) -> None:
        await cancelled(self._task)
        self._task = None
        for s in list(self.sessions):
            s.close()
        self._fail_all(EngineUnavailable("engine is shutting down"))
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    async def submit_prefill(self, sessions: list[BatchedSession], ids: list[int]) -> torch.Tensor:
        if not ids:
            raise InvalidRequest("The prompt is empty.", param="prompt")
        if len(ids) > self.max_model_len:
            raise ContextLengthExceeded(
                f"prompt of {len(ids)} tokens exceeds the context window of {self.max_model_len}"
            )
        if len(sessions) > self.max_batch_size:
            raise InvalidRequest(f"n={len(sessions)} exceeds the engine's batch size {self.max_batch_size}", param="n")
        self.start()
        job = PrefillJob(list(sessions), ids, asyncio.get_running_loop().create_future())
        scope = sessions[0].scope  # one request's sessions (n choices share a prefill)
        salt = scope.prefix_salt
        entry, cached = self.prefix.lookup(ids, salt)
        if entry is not None:
            job.seed, job.done = (entry.layers, cached), cached
        job.keep = self.prefix.wants(ids, salt)
        job.salt = salt
        job.background = scope.background
        for s in sessions:
            s.future = job.future
            s.cached = cached
        queue_in(self.prefills, job, job.background, lambda j: j.background)  # live prompts ahead of batch work
        self.wake()
        try:
            return await job.future
        finally:
            for s in sessions:
                s.future = None

    def open_many(self, n: int, options: dict[str, Any] | None = None,
                  scope: RequestScope | None = None) -> list[BatchedSession]:
        return [BatchedSession(self, options, scope) for _ in range(n)]

    # ---- scheduler ----
    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._gather()
            self.batch.drop_closed()
            self.batch.apply_rollbacks()
            decode = [(i, s, s.pending[:MAX_EXTEND]) for i, s in enumerate(self.rows) if s.pending]
            jobs = plan_prefills(self.prefills, len(self.rows), self.prefill_chunk, self.max_batch_size)
            if not decode and not jobs:
                continue
            now = time.time_ns()
            for job, _ in jobs:
                for s in job.sessions:
                    s.scheduled_ns = s.scheduled_ns or now
            try:
                dec_logits = await asyncio.get_running_loop().run_in_executor(
                    self._executor, self.passes.step, self.batch, [(i, t) for i, _, t in decode], jobs)
            except Exception as exc:  # a failed forward ends the requests in it, not the server
                log.exception("forward failed")
                err = EngineFailed(f"model forward failed: {exc}")
                for _, s, _ in decode:
                    resolve(s.future, err)
                for job, _ in jobs:
                    if job in self.prefills:
                        self.prefills.remove(job)
                    resolve(job.future, err)
                self.batch.reset(err)
                self._wake.set()
                continue
            self.steps += 1
            self._last_delivered = self._deliver(decode, dec_logits, jobs)
            if self.prefills or self._last_delivered or any(s.pending for s in self.rows):
                self._wake.set()

    def _deliver(self, decode: list[tuple[int, BatchedSession, list[int]]], dec_logits: list[torch.Tensor],
                 jobs: list[tuple[PrefillJob, int]]) -> list[BatchedSession]:
        """Each decoded row takes its logits (a session whose extend is done gets them all); each finished
        prefill joins the batch. Returns the sessions served in this step."""
        delivered = []
        for (_, s, fed), logits in zip(decode, dec_logits):
            s.length += len(fed)
            rest = s.pending[len(fed):] if s.pending else []
            s.pending = rest or None
            s.received.append(logits)
            if not s.closed and not rest:
                resolve(s.future, torch.cat(s.received) if len(s.received) > 1 else s.received[0])
                delivered.append(s)
        for job, _ in jobs:
            if job.logits is None:
                continue
            self.prefills.remove(job)
            if job.kept is not None:
                self.prefix.store(job.ids, job.salt, job.kept)
                job.kept = None
            if not job.cancelled:
                self.batch.join(job)
                resolve(job.future, job.logits)
                delivered.extend(job.sessions)
        return delivered

    async def _gather(self) -> None:
        """The rows just served get a moment to submit their next token (`gather_ready`)."""
        waiting = self._last_delivered
        await gather_ready(lambda: sum(1 for s in waiting if s.pending or s.closed), len(waiting), self.gather_wait_s,
                           self._wake)

    def _fail_all(self, err: Exception) -> None:
        self.batch.reset(err)
        while self.prefills:
            resolve(self.prefills.popleft().future, err)

    # ---- one-off scoring on the forward thread, between batched steps ----
    async def score(self, ids: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One forward over ``ids`` with no cache kept (`ForwardPasses.score`)."""
        return await self._on_thread(self.passes.score, ids, k)

    async def score_continuations(self, prefix: list[int], continuations: list[list[int]],
                                  scope: RequestScope | None = None) -> list[list[float]]:
        """Multiple-choice scoring in one forward (`ForwardPasses.score_continuations`), the prefix read from the
        prefix cache as far as it holds it, and kept there for the next question with the same prefix."""
        salt = (scope or UNSCOPED).prefix_salt
        entry, cached = self.prefix.lookup(prefix, salt)
        keep = self.prefix.wants(prefix, salt)
        scores, kept = await self._on_thread(self.passes.score_continuations, prefix, continuations,
                                             (entry.layers, cached) if entry is not None else None, keep)
        if kept is not None:
            self.prefix.store(prefix, salt, kept)
        return scores

    async def _on_thread(self, fn: Callable[..., T], *args: Any) -> T:
        if self._executor is None:  # never started, or stopped: scoring must not bring the runner back
            raise EngineUnavailable("engine is not running")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
