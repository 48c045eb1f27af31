"""The Batch API's store in Redis (``server.state.store: redis://...``): every gateway replica, on any node, shares
the files, the batches and their queue of lines.

Keys, under ``server.state.key_prefix`` and ``batch``: ``file:ID`` (a hash: owner, purpose, filename, bytes,
created_at) and ``data:ID`` (its bytes); ``files:OWNER`` and ``batches:OWNER`` (sorted sets of ids, in creation
order: listings); ``b:ID`` (a hash: the batch's fields, as the SQLite store's columns, plus ``n_completed`` and
``n_failed`` as lines finish); ``open`` (the ids of unfinished batches); per batch ``b:ID:line`` (index ->
custom_id and body), ``b:ID:pending`` (a list of indexes, in file order), ``b:ID:running`` (a sorted set of
indexes by lease end), ``b:ID:claim`` (index -> claimer) and ``b:ID:result`` (index -> answer).

Claims, answers, status moves and batch-wide steps are Lua scripts (Redis runs each alone), with Redis's own
clock, so replicas need no shared clock: a line is handed to one replica at a time, an answer is kept only from
the replica that holds the line's claim, and a line whose replica died goes back to the queue when its lease
ends (at once, when that replica was on this host and its pid is gone). Files live in Redis too: keep
``server.batches.max_file_bytes`` to what Redis's memory affords.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from chorus.server.batch.store import OPEN, Line, alive, new_id

NOW = "local t = redis.call('TIME') local now = tonumber(t[1]) + tonumber(t[2]) / 1e6 "

CLAIM = NOW + """
local n, out = tonumber(ARGV[2]), {}
for _, idx in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, n)) do out[#out + 1] = idx end
if #out < n then
  local popped = redis.call('LPOP', KEYS[1], n - #out)
  if popped then for _, idx in ipairs(popped) do out[#out + 1] = idx end end
end
for _, idx in ipairs(out) do
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), idx)
  redis.call('HSET', KEYS[3], idx, ARGV[1])
end
return out
"""

ANSWER = """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[4])
redis.call('HINCRBY', KEYS[4], ARGV[3], 1)
return 1
"""

UNCLAIM = """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('LPUSH', KEYS[3], ARGV[1])
return 1
"""

MOVE = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 0 end
local ok = false
for i = 3, 2 + tonumber(ARGV[2]) do if ARGV[i] == status then ok = true end end
if not ok then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1])
redis.call('HDEL', KEYS[1], 'claimed_by', 'claim_until')
for i = 3 + tonumber(ARGV[2]), #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
if ARGV[1] == 'completed' or ARGV[1] == 'failed' or ARGV[1] == 'expired' or ARGV[1] == 'cancelled' then
  redis.call('SREM', KEYS[2], KEYS[3])
end
return 1
"""

CLAIM_BATCH = NOW + """
if redis.call('HGET', KEYS[1], 'status') ~= ARGV[1] then return 0 end
local who = redis.call('HGET', KEYS[1], 'claimed_by')
local until_ = tonumber(redis.call('HGET', KEYS[1], 'claim_until') or '0')
if who and who ~= ARGV[2] and until_ >= now then return 0 end
redis.call('HSET', KEYS[1], 'claimed_by', ARGV[2], 'claim_until', now + tonumber(ARGV[3]))
return 1
"""

INTS = ("created_at", "expires_at", "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
        "cancelling_at", "cancelled_at", "total", "completed", "failed", "bytes")
BATCH_FIELDS = ("id", "owner", "endpoint", "input_file_id", "completion_window", "status", "created_at", "expires_at",
                "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
                "cancelled_at", "output_file_id", "error_file_id", "errors", "metadata", "total", "completed",
                "failed", "claimed_by", "claim_until")


def row_of(raw: dict[bytes, bytes], fields: tuple[str, ...]) -> dict[str, Any]:
    got = {k.decode(): v.decode() for k, v in raw.items()}
    out: dict[str, Any] = {}
    for f in fields:
        v = got.get(f)
        out[f] = int(v) if v is not None and f in INTS else v
    return out


class RedisStore:
    def __init__(self, url: str, prefix: str) -> None:
        from redis.asyncio import Redis

        self.r: Any = Redis.from_url(url)  # (the client's stubs type every reply as bytes | str)
        self.p = f"{prefix}:batch"
        self._claim = self.r.register_script(CLAIM)
        self._answer = self.r.register_script(ANSWER)
        self._unclaim = self.r.register_script(UNCLAIM)
        self._move = self.r.register_script(MOVE)
        self._claim_batch = self.r.register_script(CLAIM_BATCH)

    def k(self, *parts: str) -> str:
        return ":".join((self.p, *parts))

    async def close(self) -> None:
        await self.r.aclose()

    # ---- files ----

    async def add_file(self, owner: str, purpose: str, filename: str, data: bytes) -> dict[str, Any]:
        fid = new_id("file-")
        row = {"id": fid, "owner": owner, "purpose": purpose, "filename": filename, "bytes": len(data),
               "created_at": int(time.time())}
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.set(self.k("data", fid), data)
            pipe.hset(self.k("file", fid), mapping=row)
            pipe.zadd(self.k("files", owner), {fid: time.time()})
            await pipe.execute()
        return row

    async def file(self, file_id: str, owner: str) -> dict[str, Any] | None:
        raw = await self.r.hgetall(self.k("file", file_id))
        row = row_of(raw, ("id", "owner", "purpose", "filename", "bytes", "created_at")) if raw else None
        return row if row is not None and row["owner"] == owner else None

    async def files(self, owner: str, purpose: str | None, after: str | None, limit: int,
                    order: str) -> list[dict[str, Any]]:
        ids = [i.decode() for i in await self.r.zrange(self.k("files", owner), 0, -1, desc=order == "desc")]
        if after is not None:
            ids = ids[ids.index(after) + 1:] if after in ids else []
        out = []
        for fid in ids:
            row = await self.file(fid, owner)
            if row is not None and (purpose is None or row["purpose"] == purpose):
                out.append(row)
                if len(out) >= limit:
                    break
        return out

    async def stored_bytes(self, owner: str) -> int:
        """What the key's files hold (its uploads and its batches' outputs), for its storage quota."""
        total = 0
        for fid in await self.r.zrange(self.k("files", owner), 0, -1):
            size = await self.r.hget(self.k("file", fid.decode()), "bytes")
            total += int(size or 0)
        return total

    async def delete_file(self, file_id: str, owner: str) -> bool:
        if await self.file(file_id, owner) is None:
            return False
        await self.r.delete(self.k("file", file_id), self.k("data", file_id))
        await self.r.zrem(self.k("files", owner), file_id)
        return True

    async def read(self, file_id: str) -> bytes:
        return bytes(await self.r.get(self.k("data", file_id)) or b"")

    def local_path(self, file_id: str) -> Path | None:
        return None

    # ---- batches ----

    async def add_batch(self, owner: str, endpoint: str, input_file_id: str, window: str, window_s: float,
                        metadata: dict[str, str] | None) -> dict[str, Any]:
        now = int(time.time())
        bid = new_id("batch_")
        row: dict[str, Any] = {"id": bid, "owner": owner, "endpoint": endpoint, "input_file_id": input_file_id,
                               "completion_window": window, "status": "validating", "created_at": now,
                               "expires_at": int(now + window_s), "total": 0}
        if metadata is not None:
            row["metadata"] = json.dumps(metadata)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(self.k("b", bid), mapping=row)
            pipe.zadd(self.k("batches", owner), {bid: time.time()})
            pipe.sadd(self.k("open"), bid)
            await pipe.execute()
        found = await self.batch(bid, owner)
        assert found is not None
        return found

    async def batch(self, batch_id: str, owner: str | None = None) -> dict[str, Any] | None:
        raw = await self.r.hgetall(self.k("b", batch_id))
        if not raw:
            return None
        row = row_of(raw, BATCH_FIELDS)
        return row if owner is None or row["owner"] == owner else None

    async def batches(self, owner: str, after: str | None, limit: int) -> list[dict[str, Any]]:
        ids = [i.decode() for i in await self.r.zrange(self.k("batches", owner), 0, -1, desc=True)]
        if after is not None:
            ids = ids[ids.index(after) + 1:] if after in ids else []
        rows = [await self.batch(b, owner) for b in ids[:limit]]
        return [r for r in rows if r is not None]

    async def open_batches(self) -> list[dict[str, Any]]:
        rows = [await self.batch(b.decode()) for b in await self.r.smembers(self.k("open"))]
        return sorted((r for r in rows if r is not None and r["status"] in OPEN), key=lambda r: r["created_at"])

    async def move(self, batch_id: str, from_: tuple[str, ...], to: str, **fields: Any) -> bool:
        stamp = {f"{to}_at": int(time.time())} if to != "validating" else {}
        values = {**stamp, **{k: json.dumps(v) if k in ("errors", "metadata") and v is not None else v
                              for k, v in fields.items() if v is not None}}
        args: list[Any] = [to, len(from_), *from_]
        for k, v in values.items():
            args += [k, v]
        return bool(await self._move(keys=[self.k("b", batch_id), self.k("open"), batch_id], args=args))

    async def claim_batch(self, batch_id: str, status: str, claimer: str, lease_s: float) -> bool:
        return bool(await self._claim_batch(keys=[self.k("b", batch_id)], args=[status, claimer, lease_s]))

    # ---- lines ----

    def line_keys(self, batch_id: str) -> tuple[str, str, str, str, str]:
        return (self.k("b", batch_id, "pending"), self.k("b", batch_id, "running"), self.k("b", batch_id, "claim"),
                self.k("b", batch_id, "result"), self.k("b", batch_id, "line"))

    async def add_lines(self, batch_id: str, lines: list[Line]) -> None:
        pending, _, _, _, bodies = self.line_keys(batch_id)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.delete(pending, bodies)
            for i in range(0, len(lines), 1000):
                chunk = lines[i:i + 1000]
                pipe.hset(bodies, mapping={str(ln.idx): json.dumps([ln.custom_id, ln.body]) for ln in chunk})
                pipe.rpush(pending, *(ln.idx for ln in chunk))
            pipe.hset(self.k("b", batch_id), "total", len(lines))
            await pipe.execute()

    async def claim(self, batch_id: str, claimer: str, n: int, lease_s: float) -> list[Line]:
        pending, running, claims, _, bodies = self.line_keys(batch_id)
        got = await self._claim(keys=[pending, running, claims], args=[claimer, n, lease_s])
        if not got:
            return []
        raws = await self.r.hmget(bodies, got)
        out = []
        for idx, raw in zip(got, raws):
            custom_id, body = json.loads(raw)
            out.append(Line(int(idx), custom_id, body))
        return sorted(out, key=lambda ln: ln.idx)

    async def answer(self, batch_id: str, idx: int, claimer: str, status_code: int, result: dict[str, Any]) -> bool:
        _, running, claims, results, _ = self.line_keys(batch_id)
        counter = "n_completed" if 200 <= status_code < 300 else "n_failed"
        kept = json.dumps([status_code, result])
        return bool(await self._answer(keys=[running, claims, results, self.k("b", batch_id)],
                                       args=[idx, claimer, counter, kept]))

    async def unclaim(self, batch_id: str, idx: int, claimer: str) -> None:
        pending, running, claims, _, _ = self.line_keys(batch_id)
        await self._unclaim(keys=[running, claims, pending], args=[idx, claimer])

    async def release_dead(self, me: str) -> int:
        host, n = socket.gethostname(), 0
        for b in await self.r.smembers(self.k("open")):
            pending, running, claims, _, _ = self.line_keys(b.decode())
            for idx, who in (await self.r.hgetall(claims)).items():
                h, _, rest = who.decode().partition(":")
                pid = rest.partition(":")[0]
                if h == host and pid.isdigit() and who.decode() != me and (int(pid) == os.getpid()
                                                                           or not alive(int(pid))):
                    n += int(await self._unclaim(keys=[running, claims, pending], args=[idx, who]))
        return n

    async def counts(self, batch_id: str) -> dict[str, int]:
        pending, running, _, _, _ = self.line_keys(batch_id)
        done = await self.r.hmget(self.k("b", batch_id), ["n_completed", "n_failed"])
        return {"completed": int(done[0] or 0), "failed": int(done[1] or 0),
                "pending": int(await self.r.llen(pending)), "running": int(await self.r.zcard(running))}

    async def results(self, batch_id: str) -> AsyncIterator[tuple[str, int | None, dict[str, Any] | None]]:
        _, _, _, results, bodies = self.line_keys(batch_id)
        total = int(await self.r.hget(self.k("b", batch_id), "total") or 0)
        for start in range(0, total, 1000):
            idxs = [str(i) for i in range(start, min(start + 1000, total))]
            lines, answers = await self.r.hmget(bodies, idxs), await self.r.hmget(results, idxs)
            for raw, answer in zip(lines, answers):
                custom_id = json.loads(raw)[0]
                if answer is None:
                    yield custom_id, None, None
                else:
                    status, result = json.loads(answer)
                    yield custom_id, status, result

    async def drop_lines(self, batch_id: str) -> None:
        await self.r.delete(*self.line_keys(batch_id))
