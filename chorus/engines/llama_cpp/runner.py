"""Continuous batching in one llama.cpp context: the scheduler behind `engine: llama_cpp`.

Every open sequence (a `LlamaSession`) owns one llama.cpp sequence id and its own KV cells (the cache is
split per sequence: with llama.cpp's unified cache a sequence's logits changed with where its cells lay). Each scheduler iteration gives the
sessions it just served a moment to submit their next token (`gather_ready`, as the transformers runner does:
without it a batch of 8 streams split into steps of one or two), builds one ``llama_batch`` and runs one
``llama_decode`` on the decode thread:

1. every session with tokens waiting (a decode step, or an ``extend`` of up to `MAX_EXTEND` tokens) puts
   them in, each token at its own position and sequence id, with its logits asked for;
2. the rest of the batch (up to ``n_batch`` tokens) goes to waiting prompts, in order: a prompt longer than
   what is left is fed in chunks over several iterations (chunked prefill), and only a prompt's last
   token asks for logits.

The batch lists its sequences in id order, and a new sequence takes the lowest free id: with the cache split per
sequence, llama.cpp computes together only sequences whose ids follow each other in the batch. The decode
thread reads only each session's `Feed`, taken on the event loop when the batch was planned.

A plain choice (no grammar) is driven (`LlamaSession.drive`): its sampler (`picks.TokenPicker`) runs on the
decode thread right after each decode, and the sampled token goes into the next batch there and then; the
event loop gets the picks to turn into text and streams them meanwhile. While every sequence of the batch is
driven and the event loop has nothing new (a prompt, a close: `_interrupt`), the decode thread goes on from one
decode to the next without it, as llama.cpp's own server does (measured on one stream: each token's round trip
through the event loop cost about a millisecond, against 6 to 8 for the decode itself).

Rollbacks and closes are applied on the decode thread before the next batch (``llama_memory_seq_rm``), so the
cache is never changed while a decode runs; a closed session's sequence id is free again after that. Logits
come back as full-vocabulary float32 rows (copied out of llama.cpp's buffer), so everything built on the
`Session` protocol (sampling, logit averaging, grammars, scoring) works on them unchanged.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import heapq
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from chorus.engines.core.base import cancelled, gather_ready
from chorus.engines.core.request_scope import queue_in
from chorus.engines.llama_cpp.native_batch import fill_batch, read_logits
from chorus.engines.llama_cpp.prefix_cache import PrefixCache
from chorus.engines.llama_cpp.session import MAX_EXTEND, Feed, LlamaSession, Sent, Work, finite, non_finite, pick_driven
from chorus.errors import EngineFailed, InvalidRequest

log = logging.getLogger("chorus.llama_cpp")


def _answered(sessions: list[LlamaSession]) -> int:
    """How many of ``sessions`` have submitted their next work, are driven (their next token is there), or
    closed."""
    return sum(1 for s in sessions if s.closed or s.waits() or s.driving is not None)


def _deliver(picks: Sent) -> None:
    """On the event loop: the picks of one decode to their choices (a closed one's are dropped)."""
    for d, item in picks:
        d.deliver(item)


#: prompt tokens of batch work (``background`` sessions) prefilled per step at most: a live prompt that arrives
#: during a step waits for that step, so batch prefills are spread over steps rather than piled into one
#: (`chorus bench batch`)
BACKGROUND_PREFILL = 64


class LlamaRunner:
    """Owns the context; schedules batches (decode steps first, then prefill chunks) on one decode thread."""

    def __init__(self, lib: Any, ctx: Any, *, n_vocab: int, max_model_len: int, max_batch_size: int,
                 n_batch: int, gather_wait_s: float = 0.004, cache_slots: int = 0, cache_min_tokens: int = 32) -> None:
        self.lib = lib
        self.gather_wait_s = gather_wait_s
        self.ctx = ctx
        self.mem = lib.llama_get_memory(ctx)
        self.n_vocab = n_vocab
        self.max_model_len = max_model_len
        self.n_batch = n_batch
        self.max_batch_size = max_batch_size
        self.free_seqs: list[int] = list(range(max_batch_size))  # a heap: the lowest free id is taken first
        self.sessions: set[LlamaSession] = set()
        self.decoding: list[LlamaSession] = []  # prefilled sessions that hold a sequence id
        self.waiting: deque[LlamaSession] = deque()  # prompts to prefill, in order
        self.to_free: list[int] = []  # sequence ids of closed sessions, cleared before the next batch
        # the prefix cache: sequences max_batch_size.. keep finished prefixes (prefix_cache.py)
        self.cache = PrefixCache(range(max_batch_size, max_batch_size + cache_slots), cache_min_tokens)
        self.to_keep: dict[int, tuple[list[int], str | None]] = {}  # a closed sequence's tokens and salt
        self.to_copy: list[tuple[int, int, int]] = []  # cache hits of this batch: (slot, sequence, tokens)
        self.batch = lib.llama_batch_init(n_batch, 0, 1)
        self._row = ctypes.c_float * n_vocab  # a logits row in llama.cpp's buffer
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="llama-decode")
        self.steps = 0
        self._wake = asyncio.Event()
        self._interrupt = threading.Event()  # the event loop has something new: a run of driven decodes stops
        self._task: asyncio.Task[None] | None = None
        self._loop_ref: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        if self._task is None:
            self._loop_ref = asyncio.get_running_loop()
            self._task = asyncio.create_task(self._loop(), name="llama-cpp-scheduler")

    async def stop(self) -> None:
        await cancelled(self._task)
        self._task = None
        for s in list(self.sessions):
            s.close()
        await asyncio.get_running_loop().run_in_executor(self.thread, self._free_native)
        self.thread.shutdown(wait=True)

    def _free_native(self) -> None:
        self._apply_removals()
        if self.batch is not None:
            self.lib.llama_batch_free(self.batch)
            self.batch = None

    def enqueue(self, session: LlamaSession, prefill: bool) -> None:
        if prefill:  # live prompts ahead of batch work's (`queue_in`)
            queue_in(self.waiting, session, session.background, lambda s: s.background)
        self._wake.set()
        self._interrupt.set()

    def release(self, session: LlamaSession) -> None:
        self.sessions.discard(session)
        if session in self.waiting:
            self.waiting.remove(session)
        if session in self.decoding:
            self.decoding.remove(session)
        if session.seq is not None:
            if self.cache.enabled and session.prefilled and session.tokens:
                self.to_keep[session.seq] = (list(session.tokens), session.salt)
            self.to_free.append(session.seq)
            session.seq = None
        if session.work is not None and not session.work.future.done():
            session.work.future.set_exception(EngineFailed("session closed"))
        if session.driving is not None:
            session.driving.stopped = True
        self._wake.set()
        self._interrupt.set()

    # the scheduler ------------------------------------------------------------------------------

    def _plan(self) -> list[tuple[LlamaSession, Feed]]:
        """This batch: each session in it and its `Feed`."""
        room = self.n_batch
        plan: list[tuple[LlamaSession, Feed]] = []
        live_step = self._live_first()
        for s in self.decoding:
            if live_step and s.background:
                continue  # batch work sits out the step that prefills a live prompt (its first token comes sooner)
            d = s.driving
            if d is not None and not d.stopped and room > 0 and s.seq is not None:
                plan.append((s, Feed(s.seq, d.pos, [d.token], True, True, d)))
                room -= 1
                continue
            w = s.work
            if w is None or w.future.done() or room <= 0 or s.seq is None:
                continue
            take = w.ids[w.done:w.done + min(MAX_EXTEND, room)]
            plan.append((s, Feed(s.seq, s.length, take, w.all_logits, w.done + len(take) == len(w.ids))))
            room -= len(take)
        blocked = False  # a prompt waits for sequence ids: later ones take none (first come, first served)
        background_room = BACKGROUND_PREFILL  # batch work's prompt tokens in one step: a live prompt arriving
        for s in list(self.waiting):  # mid-step waits for a short step, not for a pile of batch prefills
            if room <= 0:
                break
            w = s.work
            if w is None or w.future.done() or s.closed:
                self.waiting.remove(s)
                continue
            if live_step and s.background:
                break  # behind the live prompts (queue_in): they go alone
            if s.seq is None:
                blocked = blocked or not self._take_ids(s)
                if s.seq is None:
                    continue  # it waits; a prompt whose sequence is already held goes on
                if self.cache.enabled and w.done == 0 and s.length == 0 and not w.all_logits:
                    self._from_cache(s, w)
            if s.background and background_room <= 0:
                break
            take = w.ids[w.done:w.done + (min(room, background_room) if s.background else room)]
            ends = w.done + len(take) == len(w.ids)
            plan.append((s, Feed(s.seq, s.length, take, w.all_logits, ends)))
            room -= len(take)
            background_room -= len(take) if s.background else 0
            if ends:
                self.waiting.remove(s)
            else:
                break  # a chunk: the rest of this prompt goes in the next batches
        # in sequence-id order: with the cache split per sequence, llama.cpp puts in one micro-batch only
        # sequences whose ids follow each other in the batch (0, 1, 2, ...); any other order, or a gap, splits
        # the decode into several (measured, 8 one-token sequences: in order 34 ms a step, shuffled 63, with
        # gaps 98). Hence the order here, and the lowest free id for each new sequence.
        plan.sort(key=lambda entry: entry[1].seq)
        return plan

    def _live_first(self) -> bool:
        """A live prompt heads the queue and can start now (its sequence ids taken): this step is for live work
        only. Batch work (``background``) is queued behind live prompts and, for that one step, its decodes wait:
        the live prompt's prefill does not share the step with them (measured: `chorus bench batch`). Never while
        the live prompt waits for ids, which only the batch work's sequences may free."""
        for s in self.waiting:
            if s.work is None or s.work.future.done() or s.closed:
                continue
            if s.background or not any(o.background for o in self.sessions):
                return False
            return s.seq is not None or (self._take_ids(s) and s.seq is not None)
        return False

    def _from_cache(self, s: LlamaSession, w: Work) -> None:
        """A new sequence's prompt: start it from the longest cached prefix (the copy runs on the decode thread,
        before this batch's decode)."""
        slot, n = self.cache.lookup(w.ids, s.salt)
        if slot is None or s.seq is None:
            return
        self.to_copy.append((slot.seq, s.seq, n))
        w.done = s.length = s.cached = n
        s.tokens = w.ids[:n]

    def _take_ids(self, s: LlamaSession) -> bool:
        """Sequence ids for ``s`` and for every other session its request holds open without one (its ``n``
        choices, its prompts, an ensemble's members on this model), all at once or none: a request holding some
        of the sequences it needs while waiting for the rest could wait on others doing the same, for ever."""
        group = [s, *(g for g in self.sessions if g is not s and g.owner is not None and g.owner is s.owner
                      and g.seq is None and not g.closed)]
        if len(group) > self.max_batch_size:
            assert s.work is not None
            s.work.future.set_exception(InvalidRequest(
                f"the request needs {len(group)} sequences of this model at once; it has {self.max_batch_size} "
                "(max_batch_size)"))
            return True
        if self.to_free or len(self.free_seqs) < len(group):
            return False  # not enough ids (or a freed one is not cleared yet): wait
        for g in group:
            g.seq = heapq.heappop(self.free_seqs)
        return True

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        served: list[LlamaSession] = []  # the sessions given logits by the last batch
        while True:
            await gather_ready(functools.partial(_answered, served), len(served), self.gather_wait_s, self._wake)
            served = []
            trims: list[tuple[int, int]] = [(s.seq, s.trim_to) for s in self.decoding
                                            if s.trim_to is not None and s.seq is not None]
            for s in self.decoding:
                s.trim_to = None
            if self.to_free or trims:
                await loop.run_in_executor(self.thread, self._apply_removals, trims)
            plan = self._plan()
            if not plan:
                await self._wake.wait()
                self._wake.clear()
                continue
            self._interrupt.clear()
            now = time.time_ns()
            for s, _ in plan:
                s.scheduled_ns = s.scheduled_ns or now
            try:
                copies, self.to_copy = self.to_copy, []
                out, decodes = await loop.run_in_executor(self.thread, self._run, [f for _, f in plan], copies)
            except Exception as exc:  # the whole batch fails; every session in it gets the error
                log.exception("llama_decode failed")
                failed = EngineFailed(f"llama.cpp decode failed: {exc}")
                for s, f in plan:
                    if f.drive is not None and not f.drive.stopped:
                        f.drive.stopped = True
                        f.drive.deliver(failed)
                    if s.work is not None and not s.work.future.done():
                        s.work.future.set_exception(failed)
                continue
            self.steps += decodes
            for (s, f), rows in zip(plan, out):
                if f.drive is not None:
                    s.length = f.drive.pos
                    continue
                w = s.work
                if w is None or w.future.done() or s.closed:
                    continue
                if not finite(rows):
                    w.future.set_exception(non_finite())
                    continue
                w.done += len(f.tokens)
                s.length += len(f.tokens)
                if s.recording:
                    s.tokens.extend(f.tokens)
                w.rows.append(rows)
                if f.ends:
                    if s not in self.decoding:
                        self.decoding.append(s)
                    w.future.set_result(torch.cat(w.rows) if len(w.rows) > 1 else w.rows[0])
                    served.append(s)

    async def fork(self, source: LlamaSession, copies: Sequence[LlamaSession]) -> None:
        """Give each of ``copies`` (open, not prefilled; they took their sequence ids with ``source``, as one
        request's sessions do) the KV cells of the prefilled ``source``: ``llama_memory_seq_cp`` on the decode
        thread, between decodes (with the cache split per sequence, llama.cpp copies the source's cells into the
        other sequence's own buffer at the next decode). Each copy then decodes from the same position, exactly as
        if it had prefilled the prompt alone."""
        if not source.prefilled or source.seq is None:
            raise InvalidRequest("fork needs a prefilled source sequence")
        pairs = []
        for c in copies:
            if c.prefilled or c.work is not None or c.closed or c.seq is None:
                raise InvalidRequest("fork copies must be open, not prefilled, and hold a sequence id")
            pairs.append((source.seq, c.seq))
        await asyncio.get_running_loop().run_in_executor(self.thread, self._copy, pairs)
        for c in copies:
            c.length = source.length
            c.prefilled = True
            if c not in self.decoding:
                self.decoding.append(c)

    async def drop_cache(self) -> int:
        """Forget every cached prefix: the books now, the cells on the decode thread (after any decode that is
        running, which may have copied from them already). The tokens they held."""
        held = self.cache.held_tokens
        seqs = self.cache.clear()
        await asyncio.get_running_loop().run_in_executor(
            self.thread, lambda: [self.lib.llama_memory_seq_rm(self.mem, s, -1, -1) for s in seqs])
        return held

    def _copy(self, pairs: list[tuple[int, int]]) -> None:
        """On the decode thread: each destination sequence's cells replaced by a copy of the source's."""
        for src, dst in pairs:
            self.lib.llama_memory_seq_rm(self.mem, dst, -1, -1)
            self.lib.llama_memory_seq_cp(self.mem, src, dst, -1, -1)

    def _apply_removals(self, trims: list[tuple[int, int]] | None = None) -> None:
        """On the decode thread: clear closed sessions' sequences and cut rolled-back ones."""
        for seq, keep in trims or []:
            self.lib.llama_memory_seq_rm(self.mem, seq, keep, -1)
        for seq in self.to_free:
            tokens, salt = self.to_keep.pop(seq, (None, None))
            slot = self.cache.place(tokens, salt) if tokens else None
            if slot is not None and tokens is not None:  # its prefix into a cache slot (its old cells replaced)
                self._copy([(seq, slot.seq)])
                self.lib.llama_memory_seq_rm(self.mem, slot.seq, len(tokens), -1)
                if not self.cache.bytes_per_token:  # the KV state of one sequence, per token
                    self.cache.bytes_per_token = int(self.lib.llama_state_seq_get_size(self.ctx, slot.seq)) // len(tokens)
            self.lib.llama_memory_seq_rm(self.mem, seq, -1, -1)
            heapq.heappush(self.free_seqs, seq)
        self.to_free.clear()

    def _run(self, feeds: list[Feed], copies: list[tuple[int, int, int]] | None = None) -> tuple[list[torch.Tensor], int]:
        """On the decode thread: the batch's cache hits copied in (``copies``: slot, sequence, tokens kept), then
        decode the planned feeds and sample the driven ones; then, while every sequence in the batch is driven
        and the event loop has nothing new, decode their tokens again, and again. Returns the first decode's
        logits rows (each planned feed's: the event loop settles the plan from them) and how many decodes ran."""
        for src, dst, n in copies or []:
            self._copy([(src, dst)])
            self.lib.llama_memory_seq_rm(self.mem, dst, n, -1)
        first = out = self._decode(feeds)
        decodes = 1
        while True:
            feeds, picks = pick_driven(feeds, out)
            if not feeds or self._interrupt.is_set():
                self._send(picks)
                return first, decodes
            out = self._decode(feeds, picks)
            decodes += 1

    def _send(self, picks: Sent) -> None:
        """From the decode thread: picks to the event loop. Sent just before the next llama_decode, which lets go
        of the GIL: sent earlier, the event loop's work on them (text, the SSE write) held the GIL while this
        thread still needed it to set up the decode (measured: a quarter of a millisecond a token)."""
        if picks and self._loop_ref is not None:
            self._loop_ref.call_soon_threadsafe(_deliver, picks)

    def _decode(self, feeds: list[Feed], picks: Sent | None = None) -> list[torch.Tensor]:
        """On the decode thread: one llama_decode of the planned tokens; each feed's logits rows. It reads only
        the feeds (taken on the event loop), never a session, which a client going away may close meanwhile.
        ``picks``: the previous decode's, sent to the event loop once the batch is set up. A driven feed's row
        is a view of llama.cpp's logits buffer, valid until the next decode: only `pick_driven` reads it (measured: the
        copy took a third of the decode thread's time between two decodes)."""
        wanted = fill_batch(self.batch, feeds)
        if picks:
            self._send(picks)
        rc = self.lib.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}" + (" (no KV cells free: raise n_ctx)" if rc == 1 else ""))
        return read_logits(self.lib, self.ctx, self._row, self.n_vocab, feeds, wanted)
