"""``SQLiteStore``: the embedded default store, one SQLite file in WAL mode.

Threads. sqlite3 is blocking, so no SQL ever runs on the event loop: every write runs on one dedicated writer
thread (one connection, so writes are serialised and never contend inside the process) and every read on one
reader thread with its own connection (WAL lets it read the last committed state while the writer writes).

Durability. ``journal_mode=WAL`` with ``synchronous=NORMAL`` (the default here): a transaction is committed once
its frames are appended to the WAL with ``write()``, which puts them in the OS page cache before ``COMMIT``
returns. Killing the process (``kill -9``) at any moment therefore never loses a committed transaction and never
corrupts the file: an interrupted transaction is simply absent on reopen. Only an OS crash or power cut can lose
the last transactions before a checkpoint; pass ``synchronous="FULL"`` to fsync the WAL on every commit when that
matters more than write latency (about an fsync per commit).

Lifecycle rules are not written here: every move goes through ``lightning_sdk.store._lifecycle`` (shared with
``MemoryStore``), which checks the state tables of ``lightning_sdk.types``.

Token cache. The proxy looks up an attempt by its token on every request, so the running attempts are kept in a
dict keyed by token: filled when the file is opened, on claim and open_session, updated on heartbeat and dropped
when the attempt ends (all on the writer thread, right after the commit). This assumes this object is the only
writer of the file's attempts (the daemon's store); other processes use ``HTTPStore``.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, TypeVar

from lightning_sdk.errors import LightningSDKError, StoreError, StoreUnavailableError
from lightning_sdk.store import _lifecycle as lc
from lightning_sdk.store import _sqlite_ops as ops
from lightning_sdk.store import _sqlite_rows as rows
from lightning_sdk.store._clock import Clock, system_clock
from lightning_sdk.store._events import AttemptEnds
from lightning_sdk.types import (
    Attempt,
    AttemptStatus,
    Call,
    Claim,
    FinishedGroup,
    Group,
    PolicyVersion,
    Resource,
    Reward,
    Rollout,
    RolloutDetail,
    RolloutStatus,
    Task,
)

__all__ = ["SQLiteStore"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


class SQLiteStore:
    """The ``Store`` protocol over one SQLite file (created with its schema if missing)."""

    def __init__(
        self,
        path: str | Path,
        *,
        synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
        busy_timeout_s: float = 10.0,
        clock: Clock = system_clock,
    ) -> None:
        if synchronous not in ("NORMAL", "FULL"):
            raise StoreError(f"synchronous must be 'NORMAL' or 'FULL', got {synchronous!r}")
        self.path = Path(path)
        self.clock = clock  # what "now" is for leases (tests drive a ManualClock)
        self._closed = False
        self._running: dict[str, Attempt] = {}  # token -> running attempt (see module docstring)
        self._cache_lock = threading.Lock()
        self._finished = lc.FinishedCache()  # finished groups already loaded (used on the reader thread only)
        self.attempt_ends = AttemptEnds()  # bumped when attempts end: the trainer waits on it (store/_events.py)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="lsdk-store-writer")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="lsdk-store-reader")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._wconn = rows.connect(
                str(self.path), synchronous=synchronous, busy_timeout_s=busy_timeout_s, readonly=False
            )
            self._open_schema()
            self._rconn = rows.connect(
                str(self.path), synchronous=synchronous, busy_timeout_s=busy_timeout_s, readonly=True
            )
            for attempt in ops.running_attempts(self._wconn):
                self._running[attempt.token] = attempt
        except (sqlite3.Error, StoreError) as exc:
            self._writer.shutdown(wait=False)
            self._reader.shutdown(wait=False)
            if isinstance(exc, StoreError):
                raise
            raise _translate(exc, self.path) from exc
        logger.info(
            "opened store %s (WAL, synchronous=%s, %d running attempts)", self.path, synchronous, len(self._running)
        )

    def _open_schema(self) -> None:
        """Create the schema in a new file, or migrate a file of an older version (in one transaction)."""
        conn = self._wconn
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version == rows.SCHEMA_VERSION:
            return
        if version not in (0, 1):
            raise StoreError(
                f"{self.path}: schema version {version}, this lightning_sdk reads {rows.SCHEMA_VERSION} "
                "(and migrates 1): a newer lightning_sdk wrote it"
            )
        conn.execute("BEGIN IMMEDIATE")
        try:
            if conn.execute("PRAGMA user_version").fetchone()[0] != rows.SCHEMA_VERSION:  # not another opener's
                for statement in _statements(rows.SCHEMA):
                    conn.execute(statement)
                if version == 1:
                    logger.info("migrating store %s from schema 1 to %d", self.path, rows.SCHEMA_VERSION)
                    for statement in _statements(rows.MIGRATE_1_TO_2):
                        conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {rows.SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    # -- plumbing -----------------------------------------------------------------------------------------------
    async def _write(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(conn, *args)`` in one IMMEDIATE transaction on the writer thread."""
        return await self._run(self._writer, self._in_txn, fn, args, "BEGIN IMMEDIATE", False)

    async def _write_attempts(self, fn: Callable[..., T], *args: Any) -> T:
        """``_write`` for moves of attempts: the attempts in the result update the token cache after COMMIT."""
        return await self._run(self._writer, self._in_txn, fn, args, "BEGIN IMMEDIATE", True)

    async def _read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(conn, *args)`` in one read transaction (a consistent snapshot) on the reader thread."""
        return await self._run(self._reader, self._in_txn, fn, args, "BEGIN", False)

    async def _run(self, pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise StoreUnavailableError(f"store {self.path} is closed")
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def _in_txn(self, fn: Callable[..., T], args: tuple[Any, ...], begin: str, update_cache: bool) -> T:
        conn = self._wconn if begin == "BEGIN IMMEDIATE" else self._rconn
        try:
            conn.execute(begin)
            try:
                result = fn(conn, *args)
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
        except LightningSDKError:
            raise
        except sqlite3.Error as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise _translate(exc, self.path) from exc
        if update_cache:
            for attempt in _attempts_in(result):
                self._cache_put(attempt)
        return result

    def _cache_put(self, attempt: Attempt) -> None:
        with self._cache_lock:
            if attempt.status is AttemptStatus.RUNNING:
                self._running[attempt.token] = attempt
            else:
                self._running.pop(attempt.token, None)

    # -- tasks, groups, rollouts ---------------------------------------------------------------------------------
    async def enqueue(
        self,
        tasks: list[Task],
        *,
        n: int = 1,
        max_attempts: int = 1,
        split: str = "train",
        group_ids: list[str] | None = None,
    ) -> list[Group]:
        return await self._write(ops.enqueue, tasks, n, max_attempts, split, group_ids, self.clock())

    async def open_session(
        self, task: Task | None = None, group_id: str | None = None, *, split: str = "train"
    ) -> Claim:
        return await self._write_attempts(ops.open_session, task, group_id, self.clock(), split)

    async def claim(self, worker_id: str, *, lease_s: float = 60.0, split: str | None = None) -> Claim | None:
        return await self._write_attempts(ops.claim, worker_id, lease_s, split, self.clock())

    async def heartbeat(self, attempt_id: str, *, lease_s: float = 60.0) -> Attempt:
        return await self._write_attempts(ops.heartbeat, attempt_id, lease_s, self.clock())

    async def finish_attempt(self, attempt_id: str, status: AttemptStatus, error: str | None = None) -> Attempt:
        attempt = await self._write_attempts(ops.finish, attempt_id, AttemptStatus(status), error, self.clock())
        self.attempt_ends.bump()
        return attempt

    async def expire_leases(self) -> list[Attempt]:
        expired = await self._write_attempts(ops.expire, self.clock())
        self.attempt_ends.bump(len(expired))
        return expired

    async def cancel_rollout(self, rollout_id: str) -> Rollout:
        rollout = await self._write(ops.cancel, rollout_id, self.clock())
        self.attempt_ends.bump()
        return rollout

    async def get_attempt(self, attempt_id: str) -> Attempt:
        return await self._read(ops.get_attempt, attempt_id)

    # -- calls and rewards ---------------------------------------------------------------------------------------
    async def attempt_by_token(self, token: str) -> Attempt | None:
        cached = self._running.get(token)
        if cached is not None and not lc.lease_expired(cached, self.clock()):  # else: read what the store says
            return cached.model_copy()
        return await self._read(ops.attempt_by_token, token)

    async def record_calls(self, calls: list[Call]) -> None:
        if calls:
            await self._write(ops.record_calls, calls)

    async def record_rewards(self, rewards: list[Reward]) -> None:
        if rewards:
            await self._write(ops.record_rewards, rewards)

    # -- reading -------------------------------------------------------------------------------------------------
    async def get_rollout(self, rollout_id: str) -> RolloutDetail:
        return await self._read(ops.get_rollout, rollout_id)

    async def list_rollouts(
        self, *, status: RolloutStatus | None = None, limit: int = 100, after: str | None = None
    ) -> tuple[list[Rollout], str | None]:
        return await self._read(ops.list_rollouts, status, limit, after)

    async def list_rollout_details(
        self, *, limit: int = 100, after: str | None = None
    ) -> tuple[list[RolloutDetail], str | None]:
        return await self._read(ops.list_rollout_details, limit, after)

    async def list_group_details(
        self, *, split: str | None = None, limit: int = 64, after: str | None = None
    ) -> tuple[list[FinishedGroup], str | None]:
        return await self._read(ops.list_group_details, split, limit, after)

    async def counts(self) -> dict[str, int]:
        return await self._read(ops.counts)

    # -- training ------------------------------------------------------------------------------------------------
    async def finished_groups(self, *, limit: int = 64, split: str = "train") -> list[FinishedGroup]:
        return await self._read(ops.finished_groups, limit, split, self._finished)

    async def consume_groups(self, step: int, group_ids: list[str]) -> list[str]:
        return await self._write(ops.consume_groups, step, group_ids)

    async def publish_version(self, version: PolicyVersion) -> None:
        await self._write(ops.publish_version, version)

    async def current_version(self) -> PolicyVersion | None:
        return await self._read(ops.current_version)

    async def set_resource(self, resource: Resource) -> None:
        await self._write(ops.set_resource, resource)

    async def get_resources(self) -> list[Resource]:
        return await self._read(ops.get_resources)

    async def set_meta(self, key: str, value: Any) -> None:
        await self._write(ops.set_meta, key, value)

    async def get_meta(self, key: str) -> Any | None:
        return await self._read(ops.get_meta, key)

    async def close(self) -> None:
        """Close both connections after the operations in flight (idempotent); later calls raise
        ``StoreUnavailableError``. SQLite checkpoints the WAL into the file when its last connection closes."""
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._reader, self._rconn.close)
        await loop.run_in_executor(self._writer, self._wconn.close)  # the last connection to close checkpoints
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)


def _statements(script: str) -> list[str]:
    """The statements of an SQL script (``executescript`` would commit the transaction it runs in)."""
    out: list[str] = []
    buf = ""
    for line in script.splitlines(keepends=True):
        buf += line
        if sqlite3.complete_statement(buf):
            out.append(buf.strip())
            buf = ""
    if buf.strip():
        out.append(buf.strip())
    return out


def _attempts_in(result: Any) -> list[Attempt]:
    if isinstance(result, Attempt):
        return [result]
    if isinstance(result, Claim):
        return [result.attempt]
    if isinstance(result, list):
        return [a for a in result if isinstance(a, Attempt)]
    return []


def _translate(exc: sqlite3.Error, path: Path) -> StoreError:
    """sqlite3 errors as lightning_sdk errors (the caller raises it ``from exc``)."""
    text = str(exc)
    if isinstance(exc, sqlite3.OperationalError) and ("locked" in text or "busy" in text):
        return StoreUnavailableError(f"store {path}: database is locked by another process ({text})")
    if isinstance(exc, sqlite3.IntegrityError):
        return StoreError(f"store {path}: constraint violated ({text})")
    if isinstance(exc, (sqlite3.OperationalError, sqlite3.DatabaseError)):
        return StoreUnavailableError(f"store {path}: {text}")
    return StoreError(f"store {path}: {text}")
