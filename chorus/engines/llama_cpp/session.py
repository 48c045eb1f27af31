"""One sequence of the llama.cpp runner (`LlamaSession`, the `Session` protocol) and what it hands the decode
thread: the work it waits for (`Work`), a driven choice (`Drive`) and its part of a batch as planned (`Feed`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from chorus.engines.core.base import check_can_roll_back, check_extend, check_rollback
from chorus.engines.core.picks import Pick, TokenPicker
from chorus.engines.core.request_scope import UNSCOPED, RequestScope
from chorus.errors import ContextLengthExceeded, EngineFailed, InvalidRequest


class Scheduler(Protocol):
    """What a session asks of the batch it runs in (runner.py's `LlamaRunner`)."""

    max_model_len: int
    sessions: set[LlamaSession]  #: the open sessions

    def enqueue(self, session: LlamaSession, prefill: bool) -> None:
        """Queue the session's waiting tokens for the next batch (``prefill``: its prompt)."""

    def release(self, session: LlamaSession) -> None:
        """The session is closed: free its sequence at the next batch."""

MAX_EXTEND = 16  # tokens one session feeds in one batch (a longer extend takes several)


@dataclass
class Work:
    """What a session waits for: ``ids`` to feed, which of them need logits, and where the logits go."""

    ids: list[int]
    all_logits: bool  # an extend: every token's logits; a prefill: the last token's only
    future: asyncio.Future[torch.Tensor]
    done: int = 0  # tokens already fed (chunked prefill, long extends)
    rows: list[torch.Tensor] = field(default_factory=list)  # each batch's logits rows, joined at the end


@dataclass(eq=False)
class Drive:
    """A driven choice: its sampler, the token it sampled last (not fed yet) and that token's position, and
    where its picks go (on the event loop). Between runs the event loop plans from it; during a run only the
    decode thread changes it, except ``stopped``, which the event loop sets when the session closes."""

    picker: TokenPicker
    token: int
    pos: int
    deliver: Callable[[Pick | BaseException], None]
    stopped: bool = False


Sent = list[tuple[Drive, Pick | BaseException]]  # a decode's picks, for the event loop


@dataclass(frozen=True)
class Feed:
    """One session's part of a batch, as planned: its sequence id, the position of its first token, the tokens,
    and whether every token's logits are wanted (an extend) or only the last one's, when the work ``ends``;
    ``drive``: a driven choice's one token, sampled after the decode on the decode thread."""

    seq: int
    start: int
    tokens: list[int]
    all_logits: bool
    ends: bool
    drive: Drive | None = None


class LlamaSession:
    """One sequence: the `Session` protocol over a `LlamaRunner` (as its `Scheduler`)."""

    def __init__(self, runner: Scheduler, scope: RequestScope | None = None) -> None:
        self._runner = runner
        scope = scope or UNSCOPED
        self.seq: int | None = None  # the llama.cpp sequence id, taken at prefill
        self.length = 0  # tokens in the cache
        self.work: Work | None = None
        self.prefilled = False
        self.closed = False
        self.trim_to: int | None = None  # a rollback to apply before the next batch
        self.driving: Drive | None = None
        # the token ids its cells hold, from the start, as far as known (the prefix cache stores them when it
        # closes): the prompt and extends; a driven choice's sampled tokens are not recorded (``recording``)
        self.tokens: list[int] = []
        self.recording = True
        self.cached = 0  # prompt tokens its prefill read from the prefix cache
        self.scheduled_ns: int | None = None  # when its prefill first entered a batch (the queue span's end)
        self.salt = scope.prefix_salt  # its tenant and cache_salt: prefixes are shared only under the same one
        self.background = scope.background  # batch work: its prompt waits behind every live one
        # the request (else the task) that opened it: the sessions one request holds open without a sequence id
        # take their ids together (`LlamaRunner._take_ids`)
        self.owner = scope.owner()
        runner.sessions.add(self)

    async def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        return (await self._prefill(ids, all_logits=False))[-1]

    async def score(self, ids: Sequence[int]) -> torch.Tensor:
        """A prefill that keeps every token's logits: (len(ids), V), row j the logits after ``ids[j]`` (a whole
        prompt scored in prefill-sized chunks rather than in an extend's; never read from the prefix cache)."""
        return await self._prefill(ids, all_logits=True)

    async def _prefill(self, ids: Sequence[int], *, all_logits: bool) -> torch.Tensor:
        if self.prefilled or self.work is not None:
            raise InvalidRequest("session is already prefilled")
        if not ids:
            raise InvalidRequest("prefill needs at least one token")
        if len(ids) > self._runner.max_model_len:
            raise ContextLengthExceeded(f"prompt exceeds the context window of {self._runner.max_model_len} tokens")
        out = await self._submit(list(ids), all_logits=all_logits, prefill=True)
        self.prefilled = True
        return out

    async def step(self, token: int) -> torch.Tensor:
        return (await self.extend([token]))[-1]

    async def extend(self, ids: Sequence[int]) -> torch.Tensor:
        """Feed several tokens: (len(ids), V), row j the logits after ``ids[j]``."""
        check_extend(self.closed, self.prefilled, len(ids), self.length, self._runner.max_model_len)
        if self.driving is not None:
            raise InvalidRequest("the session is being driven")
        return await self._submit([int(t) for t in ids], all_logits=True, prefill=False)

    async def drive(self, logits: torch.Tensor, picker: TokenPicker) -> AsyncGenerator[Pick, None]:
        """A plain choice: the first token picked here from the prefill's logits, every later one on the decode
        thread right after the decode that gave its logits (the same sampler, so the same tokens as stepping)."""
        pick = picker(logits)
        yield pick
        if pick.final:
            return
        check_extend(self.closed, self.prefilled, 1, self.length, self._runner.max_model_len)
        picks: asyncio.Queue[Pick | BaseException] = asyncio.Queue()
        self.recording = False  # its sampled tokens are fed on the decode thread: the cells past here go unrecorded
        drive = self.driving = Drive(picker, pick.token, self.length, picks.put_nowait)
        self._runner.enqueue(self, False)
        try:
            while True:
                item = await picks.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.final:
                    return
        finally:
            drive.stopped = True
            self.driving = None

    async def _submit(self, ids: list[int], *, all_logits: bool, prefill: bool) -> torch.Tensor:
        future: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
        self.work = Work(ids, all_logits, future)
        self._runner.enqueue(self, prefill)
        try:
            return await future
        finally:
            self.work = None

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` tokens: their cells are removed from the sequence before the next batch."""
        check_can_roll_back(self.closed, self.prefilled, self.work is not None or self.driving is not None)
        check_rollback(n, self.length)
        self.length -= n
        del self.tokens[self.length:]
        self.trim_to = self.length

    def waits(self) -> bool:
        """Whether this session has submitted work the scheduler has not answered yet."""
        return self.work is not None and not self.work.future.done()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._runner.release(self)


def finite(rows: torch.Tensor) -> bool:
    """Whether every logit of these rows is a number (a row's max is NaN or inf when any entry is): a NaN row
    is a failed decode, never a sampled token (argmax of NaNs is token 0)."""
    return bool(torch.isfinite(rows.amax(dim=-1)).all())


def non_finite() -> EngineFailed:
    return EngineFailed("llama.cpp returned logits that are not numbers (NaN or inf) for this sequence; the model "
                        "or this build computes wrongly (the engine's start-up probe checks one prompt)")


def pick_driven(feeds: list[Feed], out: list[torch.Tensor]) -> tuple[list[Feed], Sent]:
    """On the decode thread: each driven feed's next token from its logits; the feeds of the next decode
    when every feed was driven (none when one was not: the event loop plans)."""
    picks: Sent = []
    again: list[Feed] = []
    alone = True  # every feed driven
    for f, rows in zip(feeds, out):
        d = f.drive
        if d is None:
            alone = False
            continue
        d.pos = f.start + 1
        if d.stopped:
            continue
        if not finite(rows[-1:]):
            d.stopped = True
            picks.append((d, non_finite()))
            continue
        try:
            pick = d.picker(rows[-1])
        except Exception as exc:  # a sampler's fault ends its choice only
            d.stopped = True
            picks.append((d, EngineFailed(f"sampling failed: {exc}")))
            continue
        picks.append((d, pick))
        if pick.final:
            d.stopped = True
        else:
            d.token = pick.token
            again.append(Feed(f.seq, d.pos, [pick.token], True, True, d))
    return (again if alone else []), picks
