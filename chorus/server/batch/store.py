"""Where files, batches and their lines are kept: SQLite (the standard library's) beside the uploaded files.

One database file, opened by every process of a node (``chorus serve --workers N``) in WAL mode: a process
*claims* what it works on with a lease, in one ``BEGIN IMMEDIATE`` transaction (SQLite's write lock), so two
processes never run the same line, and a line whose process died is claimed again when its lease runs out (or at
once, when the process that holds it is known dead: same host, its pid gone). An answer is kept only by the
process that holds the line's claim, so each line has exactly one answer.

Every call is short and local (an index lookup, a few rows written), so the methods, async to match the Redis
store's (redis_store.py, several nodes), run on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL, status TEXT NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER, expired_at INTEGER,
    cancelling_at INTEGER, cancelled_at INTEGER, output_file_id TEXT, error_file_id TEXT, errors TEXT,
    metadata TEXT, total INTEGER NOT NULL DEFAULT 0, completed INTEGER, failed INTEGER, claimed_by TEXT,
    claim_until REAL);
CREATE INDEX IF NOT EXISTS batches_open ON batches (status);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT NOT NULL, body TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending', status_code INTEGER, result TEXT, claimed_by TEXT, lease_until REAL,
    PRIMARY KEY (batch_id, idx));
CREATE INDEX IF NOT EXISTS lines_state ON lines (batch_id, state);
"""

DB = "batches.sqlite3"
OPEN = ("validating", "in_progress", "finalizing", "cancelling")  #: statuses the runner still has work in


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def this_process() -> str:
    """Who claims: host, pid and a nonce (a restarted process with a reused pid is someone else)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass
class Line:
    idx: int
    custom_id: str
    body: dict[str, Any]


class Store:
    """The embedded store: SQLite and a folder of files on this node (``dir``); the Redis store
    (redis_store.py) has the same methods."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "files").mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(root / DB, timeout=30.0, isolation_level=None,
                                  check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)

    async def close(self) -> None:
        self.db.close()

    async def read(self, file_id: str) -> bytes:
        return await asyncio.to_thread(self.path(file_id).read_bytes)

    def local_path(self, file_id: str) -> Path | None:
        """The file on this node's disk (served as it is), or None where files live elsewhere."""
        return self.path(file_id)

    def write(self) -> sqlite3.Connection:
        """A write transaction (SQLite's lock taken at once, so a claim's read and write are one step)."""
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    # ---- files ----

    def path(self, file_id: str) -> Path:
        return self.root / "files" / file_id

    async def add_file(self, owner: str, purpose: str, filename: str, data: bytes) -> dict[str, Any]:
        fid = new_id("file-")
        tmp = self.path(fid).with_suffix(".part")

        def write() -> None:  # (off the event loop: an upload may be 200 MB)
            tmp.write_bytes(data)
            tmp.replace(self.path(fid))  # whole or not at all

        await asyncio.to_thread(write)
        row = {"id": fid, "owner": owner, "purpose": purpose, "filename": filename, "bytes": len(data),
               "created_at": int(time.time())}
        self.db.execute("INSERT INTO files VALUES (:id, :owner, :purpose, :filename, :bytes, :created_at)", row)
        return row

    async def file(self, file_id: str, owner: str) -> dict[str, Any] | None:
        row = self.db.execute("SELECT * FROM files WHERE id = ? AND owner = ?", (file_id, owner)).fetchone()
        return dict(row) if row is not None else None

    async def files(self, owner: str, purpose: str | None, after: str | None, limit: int, order: str) -> list[dict[str, Any]]:
        sql, args = "SELECT * FROM files WHERE owner = ?", [owner]
        if purpose is not None:
            sql, args = sql + " AND purpose = ?", [*args, purpose]
        if after is not None:
            sql += f" AND rowid {'<' if order == 'desc' else '>'} (SELECT rowid FROM files WHERE id = ? AND owner = ?)"
            args += [after, owner]  # another key's id reads as an unknown one
        rows = self.db.execute(f"{sql} ORDER BY rowid {order} LIMIT ?", (*args, limit)).fetchall()
        return [dict(r) for r in rows]

    async def stored_bytes(self, owner: str) -> int:
        """What the key's files hold (its uploads and its batches' outputs), for its storage quota."""
        return int(self.db.execute("SELECT COALESCE(SUM(bytes), 0) FROM files WHERE owner = ?", (owner,)).fetchone()[0])

    async def delete_file(self, file_id: str, owner: str) -> bool:
        gone = self.db.execute("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)).rowcount > 0
        if gone:
            self.path(file_id).unlink(missing_ok=True)
        return gone

    # ---- batches ----

    async def add_batch(self, owner: str, endpoint: str, input_file_id: str, window: str, window_s: float,
                  metadata: dict[str, str] | None) -> dict[str, Any]:
        now = int(time.time())
        bid = new_id("batch_")
        self.db.execute(
            "INSERT INTO batches (id, owner, endpoint, input_file_id, completion_window, status, created_at, "
            "expires_at, metadata) VALUES (?, ?, ?, ?, ?, 'validating', ?, ?, ?)",
            (bid, owner, endpoint, input_file_id, window, now, int(now + window_s),
             json.dumps(metadata) if metadata is not None else None))
        found = await self.batch(bid, owner)
        assert found is not None
        return found

    async def batch(self, batch_id: str, owner: str | None = None) -> dict[str, Any] | None:
        """A batch (None: no such batch, or another owner's)."""
        row = self.db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None or (owner is not None and row["owner"] != owner):
            return None
        return dict(row)

    async def batches(self, owner: str, after: str | None, limit: int) -> list[dict[str, Any]]:
        sql, args = "SELECT * FROM batches WHERE owner = ?", [owner]
        if after is not None:
            sql += " AND rowid < (SELECT rowid FROM batches WHERE id = ? AND owner = ?)"
            args += [after, owner]
        return [dict(r) for r in self.db.execute(f"{sql} ORDER BY rowid DESC LIMIT ?", (*args, limit)).fetchall()]

    async def open_batches(self) -> list[dict[str, Any]]:
        marks = ",".join("?" * len(OPEN))
        return [dict(r) for r in self.db.execute(f"SELECT * FROM batches WHERE status IN ({marks})", OPEN)]

    async def move(self, batch_id: str, from_: tuple[str, ...], to: str, **fields: Any) -> bool:
        """Set the batch's status to ``to`` (and ``fields``) if it is in one of ``from_``: True if it moved."""
        now = int(time.time())
        stamp = {f"{to}_at": now} if to not in ("validating",) else {}
        values = {**stamp, **{k: json.dumps(v) if k in ("errors", "metadata") and v is not None else v
                              for k, v in fields.items()}}
        sets = ", ".join(["status = ?", "claimed_by = NULL", "claim_until = NULL", *(f"{k} = ?" for k in values)])
        marks = ",".join("?" * len(from_))
        cur = self.db.execute(f"UPDATE batches SET {sets} WHERE id = ? AND status IN ({marks})",
                              (to, *values.values(), batch_id, *from_))
        return cur.rowcount > 0

    async def claim_batch(self, batch_id: str, status: str, claimer: str, lease_s: float) -> bool:
        """Hold a batch-wide step (validating it, writing its files) for ``lease_s``: True if this process got it."""
        now = time.time()
        cur = self.db.execute(
            "UPDATE batches SET claimed_by = ?, claim_until = ? WHERE id = ? AND status = ? AND "
            "(claimed_by IS NULL OR claimed_by = ? OR claim_until < ?)",
            (claimer, now + lease_s, batch_id, status, claimer, now))
        return cur.rowcount > 0

    # ---- lines ----

    async def add_lines(self, batch_id: str, lines: list[Line]) -> None:
        db = self.write()
        try:
            db.executemany("INSERT INTO lines (batch_id, idx, custom_id, body) VALUES (?, ?, ?, ?)",
                           ((batch_id, ln.idx, ln.custom_id, json.dumps(ln.body)) for ln in lines))
            db.execute("UPDATE batches SET total = ? WHERE id = ?", (len(lines), batch_id))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    async def claim(self, batch_id: str, claimer: str, n: int, lease_s: float) -> list[Line]:
        """Up to ``n`` of the batch's lines not answered and not held (or held past their lease), now held by
        ``claimer``, in file order."""
        now = time.time()
        db = self.write()
        try:
            rows = db.execute(
                "SELECT idx, custom_id, body FROM lines WHERE batch_id = ? AND (state = 'pending' OR "
                "(state = 'running' AND lease_until < ?)) ORDER BY idx LIMIT ?", (batch_id, now, n)).fetchall()
            db.executemany("UPDATE lines SET state = 'running', claimed_by = ?, lease_until = ? WHERE batch_id = ? "
                           "AND idx = ?", ((claimer, now + lease_s, batch_id, r["idx"]) for r in rows))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return [Line(r["idx"], r["custom_id"], json.loads(r["body"])) for r in rows]

    async def answer(self, batch_id: str, idx: int, claimer: str, status_code: int, result: dict[str, Any]) -> bool:
        """Keep a line's answer, only if ``claimer`` still holds it (False: someone else does; this one is
        dropped)."""
        cur = self.db.execute(
            "UPDATE lines SET state = 'done', status_code = ?, result = ?, claimed_by = NULL, lease_until = NULL "
            "WHERE batch_id = ? AND idx = ? AND state = 'running' AND claimed_by = ?",
            (status_code, json.dumps(result), batch_id, idx, claimer))
        return cur.rowcount > 0

    async def unclaim(self, batch_id: str, idx: int, claimer: str) -> None:
        """Give a line back unanswered (to be run again: the server was busy, or is stopping)."""
        self.db.execute("UPDATE lines SET state = 'pending', claimed_by = NULL, lease_until = NULL WHERE "
                        "batch_id = ? AND idx = ? AND state = 'running' AND claimed_by = ?", (batch_id, idx, claimer))

    async def release_dead(self, me: str) -> int:
        """Lines held by a process of this host that is gone (killed: its leases would hold them for nothing), or
        by an earlier life of this very pid (a container's pid 1 restarted)."""
        host = socket.gethostname()
        dead = []
        for (who,) in self.db.execute("SELECT DISTINCT claimed_by FROM lines WHERE state = 'running'"):
            h, _, rest = (who or "").partition(":")
            pid = rest.partition(":")[0]
            if h == host and pid.isdigit() and who != me and (int(pid) == os.getpid() or not alive(int(pid))):
                dead.append(who)
        n = 0
        for who in dead:
            n += self.db.execute("UPDATE lines SET state = 'pending', claimed_by = NULL, lease_until = NULL "
                                 "WHERE state = 'running' AND claimed_by = ?", (who,)).rowcount
            self.db.execute("UPDATE batches SET claimed_by = NULL, claim_until = NULL WHERE claimed_by = ?", (who,))
        return n

    async def counts(self, batch_id: str) -> dict[str, int]:
        """Lines answered (``completed``: 2xx; ``failed``: an error answer) and not yet (``pending``, ``running``)."""
        out = {"completed": 0, "failed": 0, "pending": 0, "running": 0}
        for state, ok, n in self.db.execute(
                "SELECT state, status_code BETWEEN 200 AND 299, COUNT(*) FROM lines WHERE batch_id = ? "
                "GROUP BY state, status_code BETWEEN 200 AND 299", (batch_id,)):
            key = ("completed" if ok else "failed") if state == "done" else state
            out[key] += n
        return out

    async def results(self, batch_id: str) -> AsyncIterator[tuple[str, int | None, dict[str, Any] | None]]:
        """Every line in file order: custom_id, status code (None: not answered), the kept answer."""
        for r in self.db.execute("SELECT custom_id, status_code, result FROM lines WHERE batch_id = ? ORDER BY idx",
                                 (batch_id,)):
            yield r["custom_id"], r["status_code"], json.loads(r["result"]) if r["result"] else None

    async def drop_lines(self, batch_id: str) -> None:
        """A finished batch's lines (its answers now live in its output and error files)."""
        self.db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
