"""Continuous batching over a Hugging Face causal LM.

Every open sequence (a `BatchedSession`) is one row of a single batched KV cache. Each scheduler
iteration runs, in a worker thread:

1. one decode forward for every row that has a token waiting (rows without one get a masked padding
   column, so sequences join, idle and leave between steps without disturbing the others), and
2. prefill work of at most ``prefill_chunk`` tokens: either several waiting prompts together in one
   right-padded forward (a burst of requests gets its first tokens at once), or one chunk of a prompt
   longer than that (chunked prefill: a long prompt delays the running sequences by one chunk per
   step, not by its whole length).

A finished prefill joins the batch: both caches are left-padded to the same length and concatenated
along the batch axis (``n`` copies for ``n`` choices share one prefill). Closed rows leave at the next
iteration; columns that are padding for every remaining row are trimmed. Masks (4-D boolean, with the
sliding window computed on real positions) and position ids are built here, so padding never shifts
a row's positions.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from chorus.engines.base import check_rollback
from chorus.engines.families.kv_cache import GrowingCache, cache_from
from chorus.engines.families.observer import DenseObserver, FamilyObserver
from chorus.errors import ContextLengthExceeded, EngineFailed, EngineUnavailable, InvalidRequest

log = logging.getLogger("chorus.batching")
T = TypeVar("T")
#: most tokens one row feeds in one decode forward (a longer `extend` takes several; the other rows pay
#: padding columns up to this width, never a whole catch-up's)
MAX_EXTEND = 16
#: the fewest hole columns (rolled back in one row, still used by another) worth a compaction
COMPACT_MIN = 8


class BatchedSession:
    """One sequence (one row of the batch); the `Session` protocol over a `BatchRunner`."""

    def __init__(self, runner: BatchRunner, options: dict[str, Any] | None = None) -> None:
        self._runner = runner
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
        runner.sessions.add(self)

    async def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        if self.joined or self.future is not None:
            raise InvalidRequest("session is already prefilled")
        return await self._runner.submit_prefill([self], list(ids))

    async def step(self, token: int) -> torch.Tensor:
        return (await self.extend([token]))[-1]

    async def extend(self, ids: Sequence[int]) -> torch.Tensor:
        """Several tokens in the batch's decode forwards (up to `MAX_EXTEND` a forward): (len(ids), V)."""
        if self.closed:
            raise EngineFailed("session is closed")
        if not self.joined:
            raise InvalidRequest("prefill the session before stepping it")
        if not ids:
            raise InvalidRequest("extend needs at least one token")
        if self.length + len(ids) > self._runner.max_model_len:
            raise ContextLengthExceeded(f"session exceeds the context window of {self._runner.max_model_len} tokens")
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
        if self.closed or not self.joined:
            raise InvalidRequest("rollback needs an open, prefilled session")
        if self.future is not None:
            raise InvalidRequest("rollback while the session is running a forward")
        check_rollback(n, self.length)
        self.length -= n
        self.dropping += n

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pending = None
            self._runner.sessions.discard(self)
            self._runner.wake()


@dataclass
class _Prefill:
    sessions: list[BatchedSession]
    ids: list[int]
    future: asyncio.Future[torch.Tensor]
    done: int = 0
    cache: GrowingCache = field(default_factory=GrowingCache)
    logits: torch.Tensor | None = None

    @property
    def cancelled(self) -> bool:
        return self.future.done() or all(s.closed for s in self.sessions)


class BatchRunner:
    def __init__(self, model: Any, *, max_model_len: int, max_batch_size: int = 16,
                 prefill_chunk: int = 512, gather_wait_s: float = 0.004, observer: FamilyObserver | None = None) -> None:
        self.model = model
        #: the model family's hooks around every forward (dense: none)
        self.observer = observer if observer is not None else DenseObserver()
        self.device = next(model.parameters()).device
        self.max_model_len = max_model_len
        self.max_batch_size = max_batch_size
        self.prefill_chunk = prefill_chunk
        self.gather_wait_s = gather_wait_s
        cfg = model.config.get_text_config()
        self.sliding_window: int | None = getattr(cfg, "sliding_window", None)
        self.layer_types: list[str] | None = getattr(cfg, "layer_types", None)
        self._uses_sliding = bool(self.layer_types and "sliding_attention" in self.layer_types and self.sliding_window)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.sessions: set[BatchedSession] = set()
        self.rows: list[BatchedSession] = []
        self.cache: GrowingCache | None = None
        self.mask: torch.Tensor | None = None  # (B, T) 1 = real token
        self.prefills: deque[_Prefill] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._last_delivered: list[BatchedSession] = []
        self.steps = 0
        # One dedicated thread runs every forward: torch's OpenMP team stays bound to it, instead of
        # each pool thread spinning up its own team that competes for the same cores.
        self._executor: ThreadPoolExecutor | None = None

    # ---- API used by sessions (event-loop thread) ----
    def wake(self) -> None:
        self._wake.set()

    def start(self) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chorus-forward")
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="chorus-batch-runner")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
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
            raise ContextLengthExceeded(f"prompt of {len(ids)} tokens exceeds the context window of {self.max_model_len}")
        if len(sessions) > self.max_batch_size:
            raise InvalidRequest(f"n={len(sessions)} exceeds the engine's batch size {self.max_batch_size}", param="n")
        self.start()
        job = _Prefill(sessions, ids, asyncio.get_running_loop().create_future())
        for s in sessions:
            s.future = job.future
        self.prefills.append(job)
        self.wake()
        try:
            return await job.future
        finally:
            for s in sessions:
                s.future = None

    def open_many(self, n: int, options: dict[str, Any] | None = None) -> list[BatchedSession]:
        return [BatchedSession(self, options) for _ in range(n)]

    # ---- scheduler ----
    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._gather()
            self._drop_closed()
            self._apply_rollbacks()
            decode = [(i, s, s.pending[:MAX_EXTEND]) for i, s in enumerate(self.rows) if s.pending]
            jobs = self._next_prefills()
            if not decode and not jobs:
                continue
            try:
                dec_logits = await asyncio.get_running_loop().run_in_executor(
                    self._executor, self._forward, [(i, t) for i, _, t in decode], jobs)
            except Exception as exc:  # a failed forward ends the requests in it, not the server
                log.exception("forward failed")
                err = EngineFailed(f"model forward failed: {exc}")
                for _, s, _ in decode:
                    _resolve(s.future, err)
                for job, _ in jobs:
                    if job in self.prefills:
                        self.prefills.remove(job)
                    _resolve(job.future, err)
                self._reset_batch(err)
                self._wake.set()
                continue
            self.steps += 1
            delivered = []
            for (_, s, fed), logits in zip(decode, dec_logits):
                s.length += len(fed)
                rest = s.pending[len(fed):] if s.pending else []
                s.pending = rest or None
                s.received.append(logits)
                if not s.closed and not rest:
                    _resolve(s.future, torch.cat(s.received) if len(s.received) > 1 else s.received[0])
                    delivered.append(s)
            for job, _ in jobs:
                if job.logits is None:
                    continue
                self.prefills.remove(job)
                if not job.cancelled:
                    self._join(job)
                    _resolve(job.future, job.logits)
                    delivered.extend(job.sessions)
            self._last_delivered = delivered
            if self.prefills or delivered or any(s.pending for s in self.rows):
                self._wake.set()

    async def _gather(self) -> None:
        """Give the sequences just served a moment to submit their next token, so they share a step: up to
        ``gather_wait_s`` after the last one that did (rows that mask their logits for a grammar take a few
        tenths of a millisecond each on the event loop: a fixed window split a batch of 8 into two forwards),
        at most 8 windows in all."""
        waiting = self._last_delivered
        if not waiting:
            return
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + self.gather_wait_s
        spins = 0
        ready = sum(1 for s in waiting if s.pending or s.closed)
        while ready < len(waiting):
            now = loop.time()
            if now > deadline or now > start + 8 * self.gather_wait_s:
                break
            spins += 1
            await asyncio.sleep(0 if spins < 8 else 0.0005)
            now_ready = sum(1 for s in waiting if s.pending or s.closed)
            if now_ready > ready:
                ready, deadline = now_ready, loop.time() + self.gather_wait_s

    def _next_prefills(self) -> list[tuple[_Prefill, int]]:
        """Prefill work for this step, at most ``prefill_chunk`` tokens (padding included).

        Either several whole prompts that fit together (one padded forward), or one chunk of a
        prompt too long for the budget (chunked prefill, one chunk per step).
        """
        for job in [j for j in self.prefills if j.cancelled]:
            self.prefills.remove(job)
        budget, rows, longest = self.prefill_chunk, len(self.rows), 0
        out: list[tuple[_Prefill, int]] = []
        for job in self.prefills:
            remaining = len(job.ids) - job.done
            if rows + len(job.sessions) > self.max_batch_size:
                break  # batch full: wait for a row to leave
            if job.done > 0 or remaining > budget:  # needs chunking: alone in its step
                if not out:
                    out.append((job, min(budget, remaining)))
                break
            longest = max(longest, remaining)
            if (len(out) + 1) * longest > budget:
                break
            out.append((job, remaining))
            rows += len(job.sessions)
        return out

    # ---- batch bookkeeping (event-loop thread, never during a forward) ----
    def _join(self, job: _Prefill) -> None:
        n = len(job.sessions)
        new_t = job.cache.get_seq_length()
        new_mask = torch.ones(n, new_t, dtype=torch.long, device=self.device)
        new_layers = [(l.keys.expand(n, -1, -1, -1), l.values.expand(n, -1, -1, -1)) for l in job.cache.growing]
        if self.cache is None or self.mask is None or not self.rows:
            self.cache = cache_from([(k.contiguous(), v.contiguous()) for k, v in new_layers])
            self.mask = new_mask
        else:
            old_t = self.mask.shape[1]
            t = max(old_t, new_t)
            merged = []
            old_layers = list(self.cache.growing)
            if len(old_layers) != len(new_layers):  # MoDr: different numbers of recurrence-step slots
                old_layers, grown = self.observer.match_caches(old_layers, list(job.cache.growing))
                new_layers = [(l.keys.expand(n, -1, -1, -1), l.values.expand(n, -1, -1, -1)) for l in grown]
            for layer, (kn, vn) in zip(old_layers, new_layers):
                merged.append((torch.cat([_lpad(layer.keys, t - old_t), _lpad(kn, t - new_t)], 0),
                               torch.cat([_lpad(layer.values, t - old_t), _lpad(vn, t - new_t)], 0)))
            self.cache = cache_from(merged)
            self.mask = torch.cat([_lpad(self.mask, t - old_t), _lpad(new_mask, t - new_t)], 0)
        for s in job.sessions:
            s.length = new_t
            s.joined = True
        self.rows.extend(job.sessions)
        self.observer.joined(job.sessions)

    def _drop_closed(self) -> None:
        keep = [i for i, s in enumerate(self.rows) if not s.closed]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not keep or self.cache is None or self.mask is None:
            self.rows, self.cache, self.mask = [], None, None
            return
        idx = torch.tensor(keep, device=self.device)
        mask = self.mask.index_select(0, idx)
        first = int((mask.sum(0) > 0).nonzero()[0])  # leading columns that are padding for every row
        self.mask = mask[:, first:]
        self.cache = cache_from([(l.keys.index_select(0, idx)[:, :, first:], l.values.index_select(0, idx)[:, :, first:])
                                  for l in self.cache.growing])

    @torch.inference_mode()  # the mask and cache are inference tensors: edited in place only in this mode
    def _apply_rollbacks(self) -> None:
        """Mask out the columns of rolled-back tokens (each row's last real ones), then trim the columns at
        the end that no row uses any more (at batch size 1: the cache is exactly the session's tokens)."""
        rolled = [(r, s.dropping) for r, s in enumerate(self.rows) if s.dropping]
        if not rolled or self.mask is None or self.cache is None:
            return
        for r, n in rolled:
            real = self.mask[r].nonzero()[:, 0]
            self.mask[r, real[len(real) - n :]] = 0
            self.rows[r].dropping = 0
        used = (self.mask.sum(0) > 0).nonzero()
        end = int(used[-1]) + 1 if len(used) else 0
        if end < self.mask.shape[1]:
            self.mask = self.mask[:, :end]
            for layer in self.cache.growing:
                layer.crop(end)
        self._compact()

    def _compact(self) -> None:
        """When rolled-back holes make the batch much wider than its longest row, pack each row's real
        columns to the right of a cache that wide (one copy of the cache; rare: rollbacks are short)."""
        if self.mask is None or self.cache is None:
            return
        lens = self.mask.sum(1)
        b, t, width = self.mask.shape[0], self.mask.shape[1], int(lens.max())
        if t - width < max(COMPACT_MIN, t // 4):
            return
        idx = torch.zeros(b, width, dtype=torch.long, device=self.device)
        mask = torch.zeros(b, width, dtype=self.mask.dtype, device=self.device)
        for r in range(b):
            real = self.mask[r].nonzero()[:, 0]
            idx[r, width - len(real) :] = real
            mask[r, width - len(real) :] = 1
        layers = []
        for layer in self.cache.growing:
            k, v = layer.keys, layer.values
            gk = idx[:, None, :, None].expand(b, k.shape[1], width, k.shape[3])
            gv = idx[:, None, :, None].expand(b, v.shape[1], width, v.shape[3])
            layers.append((k.gather(2, gk), v.gather(2, gv)))
        self.cache, self.mask = cache_from(layers), mask

    def _reset_batch(self, err: Exception) -> None:
        for s in self.rows:
            _resolve(s.future, err)
            s.closed = True
        self.rows, self.cache, self.mask = [], None, None

    def _fail_all(self, err: Exception) -> None:
        self._reset_batch(err)
        while self.prefills:
            _resolve(self.prefills.popleft().future, err)

    # ---- forward passes (worker thread) ----
    @torch.inference_mode()
    def _forward(self, decode: list[tuple[int, list[int]]], jobs: list[tuple[_Prefill, int]]) -> list[torch.Tensor]:
        """One decode forward for every row (row r feeds its tokens left-aligned in W columns; rows with fewer
        or none get masked padding columns) and this step's prefill work. Returns (n_r, V) logits per row."""
        out: list[torch.Tensor] = []
        if decode:
            assert self.cache is not None and self.mask is not None
            b, w = len(self.rows), max(len(t) for _, t in decode)
            ids_rows, lens = [[0] * w for _ in range(b)], [0] * b
            served: list[BatchedSession | None] = [None] * b
            for r, tokens in decode:
                ids_rows[r][: len(tokens)] = tokens
                lens[r] = len(tokens)
                served[r] = self.rows[r]
            ids = torch.tensor(ids_rows, device=self.device)  # (B, W): one host-to-device copy
            col = (torch.arange(w)[None, :] < torch.tensor(lens)[:, None]).long().to(self.device)
            mask = torch.cat([self.mask, col], 1)  # (B, T+W)
            pos = torch.tensor([[s.length] for s in self.rows], device=self.device) + torch.arange(w, device=self.device)
            attn = self._attention_mask(pos, mask.cumsum(1) - 1, mask.bool())  # real position of each column
            res = self._observed(served, lens, w, input_ids=ids, attention_mask=attn,
                                 position_ids=pos, use_cache=True, **{self._cache_kw: self.cache})
            self.mask = mask
            rows = torch.tensor([r for r, _ in decode], device=self.device)
            logits = res.logits.index_select(0, rows).float().cpu()  # (R, W, V): one device-to-host copy
            out = [logits[j, : len(tokens)] for j, (_, tokens) in enumerate(decode)]
        if len(jobs) == 1:
            self._prefill_chunk(*jobs[0])
        elif jobs:
            self._prefill_group([job for job, _ in jobs])
        return out

    async def score(self, ids: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One forward over ``ids`` with no cache kept, on the forward thread (between batched steps):
        for positions 1.., the logprob of each token given the ones before it (L-1,), and the top ``k``
        logprobs (L-1, k) with their token ids. Only these leave the thread, not (L, V) logits."""
        return await self._on_thread(self._score, ids, k)

    def _score(self, ids: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            x = torch.tensor([ids], device=self.device)  # (1, L)
            logits = self.model(input_ids=x, use_cache=False).logits[0, :-1].float()  # (L-1, V)
            lp = torch.log_softmax(logits, dim=-1)
            del logits
            target = torch.tensor(ids[1:], device=lp.device)
            chosen = lp.gather(1, target[:, None])[:, 0]  # (L-1,)
            top_v, top_i = torch.topk(lp, k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
            return chosen.cpu(), top_v.cpu(), top_i.cpu()

    async def score_continuations(self, prefix: list[int], continuations: list[list[int]]) -> list[list[float]]:
        """Multiple-choice scoring in one forward on the forward thread, between batched steps: the prefix and
        every continuation packed into one sequence, each continuation attending to the prefix and to
        itself only (a tree mask; its positions restart after the prefix), logits only where a choice
        token is predicted. The prefix is read once and there is no padding and no cache to copy."""
        return await self._on_thread(self._score_continuations, prefix, continuations)

    async def _on_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the forward thread, between batched steps (scoring: no session, no cache kept)."""
        if self._executor is None:  # never started, or stopped: scoring must not bring the runner back
            raise EngineUnavailable("engine is not running")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _score_continuations(self, prefix: list[int], conts: list[list[int]]) -> list[list[float]]:
        n = len(prefix)
        ids, pos, seg = list(prefix), list(range(n)), [-1] * n  # segment -1: the prefix, seen by every choice
        keep = [n - 1]  # sequence positions whose logits are needed: the prefix's last predicts every first token
        rows: list[list[int]] = []  # per choice: for each of its tokens, the row of `keep` that predicts it
        for i, c in enumerate(conts):
            rows.append([0])
            for j, token in enumerate(c[:-1]):
                ids.append(token)
                pos.append(n + j)
                seg.append(i)
                keep.append(len(ids) - 1)
                rows[-1].append(len(keep) - 1)
        with torch.inference_mode():
            x = torch.tensor([ids], device=self.device)
            p = torch.tensor([pos], device=self.device)
            s = torch.tensor(seg, device=self.device)
            visible = (s[None, :] == -1) | (s[None, :] == s[:, None])  # (L, L): query row sees key column
            mask = self._attention_mask(p, p, allowed=visible[None])
            logits = self.model(input_ids=x, position_ids=p, attention_mask=mask, use_cache=False,
                                logits_to_keep=torch.tensor(keep, device=self.device)).logits[0].float()  # (K, V)
            lp = torch.log_softmax(logits, dim=-1)
            del logits
            flat_rows = torch.tensor([r for per in rows for r in per], device=self.device)
            flat_tokens = torch.tensor([t for c in conts for t in c], device=self.device)
            chosen = lp[flat_rows, flat_tokens].cpu().tolist()
        out, at = [], 0
        for c in conts:
            out.append(chosen[at : at + len(c)])
            at += len(c)
        return out

    def _observed(self, rows: list[BatchedSession | None], lens: list[int], width: int, **inputs: Any) -> Any:
        """One model forward, with the model family's observer before and after it (on this thread; the
        first session of a prefill stands for its n choices)."""
        self.observer.before(rows)
        res = self.model(**inputs)
        self.observer.after(rows, lens, width)
        return res

    def _prefill_chunk(self, job: _Prefill, n: int) -> None:
        p = job.done
        ids = torch.tensor([job.ids[p : p + n]], device=self.device)  # (1, L)
        pos = torch.arange(p, p + n, device=self.device).unsqueeze(0)  # (1, L)
        attn = self._attention_mask(pos, torch.arange(p + n, device=self.device).unsqueeze(0))
        res = self._observed([job.sessions[0]], [n], n, input_ids=ids, attention_mask=attn, position_ids=pos,
                             use_cache=True, logits_to_keep=1, **{self._cache_kw: job.cache})
        job.done += n
        if job.done == len(job.ids):
            job.logits = res.logits[0, -1, :].float().cpu()

    def _prefill_group(self, jobs: list[_Prefill]) -> None:
        """Several whole prompts in one right-padded forward; each then gets its own trimmed cache."""
        lens = torch.tensor([len(j.ids) for j in jobs], device=self.device)
        j, t = len(jobs), int(lens.max())
        ids = torch.zeros(j, t, dtype=torch.long, device=self.device)
        for row, job in enumerate(jobs):
            ids[row, : len(job.ids)] = torch.tensor(job.ids, device=self.device)
        ar = torch.arange(t, device=self.device)
        pos = ar.unsqueeze(0).expand(j, t)  # (J, T)
        attn = self._attention_mask(pos, pos, ar.view(1, t) < lens.view(j, 1))  # right padding is not a key
        last = sorted({int(n) - 1 for n in lens})
        cache = GrowingCache()
        res = self._observed([job.sessions[0] for job in jobs], [len(job.ids) for job in jobs], t, input_ids=ids,
                             attention_mask=attn, position_ids=pos, use_cache=True,
                             logits_to_keep=torch.tensor(last, device=self.device), **{self._cache_kw: cache})
        for row, job in enumerate(jobs):
            n = len(job.ids)
            job.logits = res.logits[row, last.index(n - 1), :].float().cpu()
            # _cache_from copies each slice into a buffer of its own
            job.cache = cache_from([(l.keys[row : row + 1, :, :n], l.values[row : row + 1, :, :n])
                                     for l in cache.growing])
            job.done = n

    def _attention_mask(self, q_pos: torch.Tensor, kv_pos: torch.Tensor, kv_valid: torch.Tensor | None = None,
                        allowed: torch.Tensor | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
        """4-D boolean masks from real positions: a query at position q sees real keys at positions <= q
        (and > q - window on Gemma-style sliding layers). q_pos: (B, Lq); kv_pos, kv_valid: (B, Lk);
        ``allowed`` (B, Lq, Lk): which keys a query may see at all (multiple-choice scoring's tree)."""
        causal = kv_pos[:, None, :] <= q_pos[:, :, None]  # (B, Lq, Lk)
        allowed = causal if allowed is None else causal & allowed
        if kv_valid is not None:
            allowed = allowed & kv_valid[:, None, :]
        if not self._uses_sliding:
            return allowed[:, None]
        assert self.sliding_window is not None  # _uses_sliding
        near = kv_pos[:, None, :] > q_pos[:, :, None] - self.sliding_window
        return {"full_attention": allowed[:, None], "sliding_attention": (allowed & near)[:, None]}


def _resolve(fut: asyncio.Future[torch.Tensor] | None, value: torch.Tensor | BaseException) -> None:
    if fut is None or fut.done():
        return
    if isinstance(value, BaseException):
        fut.set_exception(value)
    else:
        fut.set_result(value)


def _lpad(x: torch.Tensor, n: int) -> torch.Tensor:
    """Left-pad the sequence axis (-2 for (B, H, T, D) caches, -1 for (B, T) masks) with n zeros."""
    if n == 0:
        return x
    if x.dim() == 2:
        return torch.cat([x.new_zeros(x.shape[0], n), x], 1)
    b, h, _, d = x.shape
    return torch.cat([x.new_zeros(b, h, n, d), x], 2)
