"""``PostgresStore``: the store in a PostgreSQL database, shared by many processes (proxies, the daemon, workers).

``open_store("postgresql://user@host:port/db")`` (or ``[store] url``) opens one. The schema is created, or a
database of an older schema version migrated, when the store is opened (one transaction under an advisory lock, so
processes opening the same database at once do it once); a database written by a newer lightning_sdk is refused.

Connections. psycopg 3, async: each event loop that uses the store gets its own ``AsyncConnectionPool``
(``min_size``..``max_size`` connections; a pool is bound to the loop that opened it). Every operation is one
transaction, retried on a deadlock or serialization failure; reads run ``REPEATABLE READ, READ ONLY`` so a page of
groups with their rollouts, attempts and calls is one consistent snapshot, as in SQLite.

Many processes. Lifecycle rules live in ``_lifecycle`` (shared with the other stores); which rows each move locks,
so that concurrent processes never share a claim nor record a call after a finish, is written at the top of
``_postgres_ops``. Attempts ended in another process reach this one's ``attempt_ends`` (what the trainer waits on)
through ``LISTEN``/``NOTIFY`` on one extra connection, opened once ``attempt_ends`` is asked for (by the trainer;
a proxy holds none).

Token cache. ``attempt_by_token`` runs per proxied request: a running attempt is trusted for ``token_ttl_s``
seconds after it was read (or moved by this process), then read again, since another process may have ended it.
A stale entry is harmless: a call recorded with ``running_only`` is refused once the attempt ended anywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg_pool import AsyncConnectionPool

from lightning_sdk.errors import ConfigError, LightningSDKError, StoreError, StoreUnavailableError
from lightning_sdk.store import _lifecycle as lc
from lightning_sdk.store import _postgres_ops as ops
from lightning_sdk.store._clock import Clock, system_clock
from lightning_sdk.store._events import AttemptEnds
from lightning_sdk.store._open import redact_url as _shown
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

__all__ = ["PostgresStore"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

_RETRYABLE = (pg_errors.DeadlockDetected, pg_errors.SerializationFailure)
_TRIES = 8  # a transaction that deadlocked or failed to serialise is run again up to this many times
_SCHEMA_LOCK = 0x6C73_646B_7363_6831  # pg_advisory_xact_lock key of schema creation/migration ("lsdkschm")


class PostgresStore:
    """The ``Store`` protocol over one PostgreSQL database (``url``: a libpq URL, ``postgresql://...``)."""

    shared = True  # many proxies may serve its attempts at once: they keep their barrier here (proxy/_shared.py)

    def __init__(
        self,
        url: str,
        *,
        clock: Clock = system_clock,
        min_size: int = 1,
        max_size: int = 16,
        token_ttl_s: float = 1.0,
        connect_timeout_s: float = 10.0,
        listen: bool = True,
    ) -> None:
        if not url.startswith(("postgresql://", "postgres://")):
            raise ConfigError(f"store {url!r}: a PostgreSQL URL starts with postgresql://")
        if max_size < 1 or min_size < 0 or min_size > max_size:
            raise ConfigError(f"store: pool sizes must be 0 <= min_size <= max_size >= 1, got {min_size}, {max_size}")
        self.url = url
        self.clock = clock
        self.min_size, self.max_size = min_size, max_size
        self.token_ttl_s = token_ttl_s
        self.connect_timeout_s = connect_timeout_s
        self._ends = AttemptEnds()  # bumped by this process's ends and by NOTIFYs of the others (attempt_ends)
        self._listen = listen
        self._listen_wanted = False  # someone waits on attempt_ends (the trainer): then LISTEN
        self._closed = False
        self._lock = threading.Lock()
        self._finished = lc.FinishedCache()  # finished groups already loaded (store/_lifecycle.py)
        self._pools: dict[asyncio.AbstractEventLoop, AsyncConnectionPool[psycopg.AsyncConnection[Any]]] = {}
        self._opening: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}
        self._listener: asyncio.Task[None] | None = None
        self._running: dict[str, tuple[Attempt, float]] = {}  # token -> (running attempt, when it was read)
        try:
            with psycopg.connect(url, connect_timeout=max(1, int(connect_timeout_s))) as conn:
                self._open_schema(conn)
        except psycopg.Error as exc:
            raise _translate(exc, url) from exc
        logger.info("opened store %s (PostgreSQL, schema %d)", _shown(url), ops.SCHEMA_VERSION)

    def _open_schema(self, conn: psycopg.Connection[Any]) -> None:
        """Create the schema in an empty database, or migrate an older one, in one transaction."""
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = conn.execute("SELECT version FROM schema_version").fetchone()
            version = 0 if row is None else int(row[0])
            if version == ops.SCHEMA_VERSION:
                return
            if version > ops.SCHEMA_VERSION:
                raise StoreError(
                    f"store {_shown(self.url)}: schema version {version}, this lightning_sdk reads "
                    f"{ops.SCHEMA_VERSION}: a newer lightning_sdk wrote it"
                )
            if version == 0:
                conn.execute(ops.SCHEMA)  # a script of several statements: sent as one simple query
            else:
                for v in range(version, ops.SCHEMA_VERSION):
                    logger.info("migrating store %s from schema %d to %d", _shown(self.url), v, v + 1)
                    conn.execute(ops.MIGRATIONS[v])
            conn.execute("DELETE FROM schema_version")
            conn.execute("INSERT INTO schema_version (version) VALUES (%s)", (ops.SCHEMA_VERSION,))

    # -- plumbing -----------------------------------------------------------------------------------------------
    async def _pool(self) -> AsyncConnectionPool[psycopg.AsyncConnection[Any]]:
        """This event loop's pool (opened on first use, with the NOTIFY listener of the first loop)."""
        if self._closed:
            raise StoreUnavailableError(f"store {_shown(self.url)} is closed")
        loop = asyncio.get_running_loop()
        pool = self._pools.get(loop)
        if pool is not None:
            return pool
        with self._lock:
            opening = self._opening.setdefault(loop, asyncio.Lock())
        async with opening:
            pool = self._pools.get(loop)
            if pool is not None:
                return pool
            pool = AsyncConnectionPool(
                self.url,
                min_size=self.min_size,
                max_size=self.max_size,
                kwargs={"autocommit": True, "connect_timeout": max(1, int(self.connect_timeout_s))},
                timeout=self.connect_timeout_s,
                open=False,
                name="lightning_sdk-store",
            )
            try:
                await pool.open(wait=self.min_size > 0, timeout=self.connect_timeout_s)
            except psycopg.Error as exc:
                await pool.close()
                raise _translate(exc, self.url) from exc
            with self._lock:
                self._pools[loop] = pool
            self._start_listener()
            return pool

    @property
    def attempt_ends(self) -> AttemptEnds:
        """What the trainer waits on (store/_events.py): this process's ended attempts, and, once someone asks for
        it, every other process's (a ``LISTEN`` connection; a proxy, which never asks, holds none)."""
        self._listen_wanted = True
        self._start_listener()
        return self._ends

    def _start_listener(self) -> None:
        if not (self._listen and self._listen_wanted) or self._listener is not None or self._closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop yet: the first pool starts it
        with self._lock:
            if self._listener is None:
                self._listener = loop.create_task(self._listen_ends(), name="lightning_sdk-store-listen")

    async def _txn(self, fn: Callable[..., Awaitable[T]], *args: Any, read: bool = False) -> T:
        """``await fn(cursor, *args)`` in one transaction (a snapshot for reads), retried on deadlock."""
        pool = await self._pool()
        for attempt in range(_TRIES):
            try:
                # reads in binary: bytea arrives as its bytes (text format sends it hex-encoded, twice the size)
                async with pool.connection() as conn, conn.transaction(), conn.cursor(binary=read) as cur:
                    if read:
                        await cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                    return await fn(cur, *args)
            except _RETRYABLE as exc:
                if attempt == _TRIES - 1:
                    raise StoreUnavailableError(f"store {_shown(self.url)}: {exc}") from exc
                await asyncio.sleep(0.002 * 2**attempt)
            except LightningSDKError:
                raise
            except psycopg.Error as exc:
                raise _translate(exc, self.url) from exc
        raise AssertionError("unreachable")

    async def _single(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``await fn(cursor, *args)`` for an ``fn`` of one statement, in autocommit: one round trip instead of the
        three of BEGIN / statement / COMMIT (the per-call ``reserve_seq`` and token reads of the proxies)."""
        pool = await self._pool()
        try:
            async with pool.connection() as conn, conn.cursor(binary=True) as cur:
                return await fn(cur, *args)
        except LightningSDKError:
            raise
        except psycopg.Error as exc:
            raise _translate(exc, self.url) from exc

    async def _moved(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``_txn`` for moves of attempts: the attempts in the result update the token cache after COMMIT."""
        result = await self._txn(fn, *args)
        now = time.monotonic()
        for attempt in _attempts_in(result):
            if attempt.status is AttemptStatus.RUNNING:
                self._running[attempt.token] = (attempt, now)
            else:
                self._running.pop(attempt.token, None)
        return result

    async def _listen_ends(self) -> None:
        """Bump ``attempt_ends`` on every NOTIFY of an ended attempt (any process); reconnect when cut off."""
        while not self._closed:
            try:
                async with await psycopg.AsyncConnection.connect(
                    self.url, autocommit=True, connect_timeout=max(1, int(self.connect_timeout_s))
                ) as conn:
                    await conn.execute(f"LISTEN {ops.NOTIFY_CHANNEL}")
                    self._ends.bump()  # ends may have been missed while not listening: read once
                    async for _ in conn.notifies():
                        self._ends.bump()
            except psycopg.Error as exc:
                if self._closed:
                    return
                logger.warning(
                    "store %s: the NOTIFY listener lost its connection (%s); reconnecting", _shown(self.url), exc
                )
                await asyncio.sleep(1.0)

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
        lc.validate_enqueue(tasks, n, max_attempts, split, group_ids)
        return await self._txn(ops.enqueue, tasks, n, max_attempts, split, group_ids, self.clock())

    async def open_session(
        self, task: Task | None = None, group_id: str | None = None, *, split: str = "train"
    ) -> Claim:
        return await self._moved(ops.open_session, task, group_id, self.clock(), split)

    async def claim(self, worker_id: str, *, lease_s: float = 60.0, split: str | None = None) -> Claim | None:
        lc.check_lease_s(lease_s, "claim")
        return await self._moved(ops.claim, worker_id, lease_s, split, self.clock())

    async def heartbeat(self, attempt_id: str, *, lease_s: float = 60.0) -> Attempt:
        return await self._moved(ops.heartbeat, attempt_id, lease_s, self.clock())

    async def finish_attempt(self, attempt_id: str, status: AttemptStatus, error: str | None = None) -> Attempt:
        attempt = await self._moved(ops.finish, attempt_id, AttemptStatus(status), error, self.clock())
        self._ends.bump()
        return attempt

    async def finish_counting(
        self, attempt_id: str, status: AttemptStatus, error: str | None = None
    ) -> tuple[Attempt, int]:
        """``finish_attempt``, and how many calls of the attempt landed (from every process), counted in the same
        transaction under the attempt's exclusive lock."""
        attempt, n_calls = await self._txn(ops.finish_counting, attempt_id, AttemptStatus(status), error, self.clock())
        self._running.pop(attempt.token, None)
        self._ends.bump()
        return attempt, n_calls

    async def expire_leases(self) -> list[Attempt]:
        expired = await self._moved(ops.expire, self.clock())
        self._ends.bump(len(expired))
        return expired

    async def cancel_rollout(self, rollout_id: str) -> Rollout:
        rollout = await self._txn(ops.cancel, rollout_id, self.clock())
        self._ends.bump()
        return rollout

    async def get_attempt(self, attempt_id: str) -> Attempt:
        return await self._single(ops.get_attempt, attempt_id)

    # -- calls and rewards ---------------------------------------------------------------------------------------
    async def attempt_by_token(self, token: str) -> Attempt | None:
        cached = self._running.get(token)
        if cached is not None:
            attempt, read_at = cached
            if time.monotonic() - read_at < self.token_ttl_s and not lc.lease_expired(attempt, self.clock()):
                return attempt.model_copy()
        attempt_or_none = await self._single(ops.attempt_by_token, token)
        if attempt_or_none is not None and attempt_or_none.status is AttemptStatus.RUNNING:
            self._running[token] = (attempt_or_none, time.monotonic())
        else:
            self._running.pop(token, None)
        return attempt_or_none

    async def record_calls(self, calls: list[Call], *, running_only: bool = False) -> None:
        """Commit calls (idempotent on call_id). ``running_only``: the store-side finish barrier of many proxies
        (``_postgres_ops``): refuse the batch with ``AttemptNotRunningError`` if an attempt of it has ended."""
        if calls:
            await self._txn(ops.record_calls, calls, running_only)

    async def reserve_seq(self, attempt_id: str, n: int = 1) -> int:
        """The first of ``n`` consecutive call numbers of ``attempt_id``, unique across every process."""
        if n < 1:
            raise ConfigError(f"reserve_seq: n must be >= 1, got {n}")
        return await self._single(ops.reserve_seq, attempt_id, n)

    async def record_rewards(self, rewards: list[Reward]) -> None:
        if rewards:
            await self._txn(ops.record_rewards, rewards)

    # -- reading -------------------------------------------------------------------------------------------------
    async def get_rollout(self, rollout_id: str) -> RolloutDetail:
        return await self._txn(ops.get_rollout, rollout_id, read=True)

    async def list_rollouts(
        self, *, status: RolloutStatus | None = None, limit: int = 100, after: str | None = None
    ) -> tuple[list[Rollout], str | None]:
        return await self._txn(ops.list_rollouts, status, limit, after, read=True)

    async def list_rollout_details(
        self, *, limit: int = 100, after: str | None = None
    ) -> tuple[list[RolloutDetail], str | None]:
        return await self._txn(ops.list_rollout_details, limit, after, read=True)

    async def list_group_details(
        self, *, split: str | None = None, limit: int = 64, after: str | None = None
    ) -> tuple[list[FinishedGroup], str | None]:
        return await self._txn(ops.list_group_details, split, limit, after, read=True)

    async def counts(self) -> dict[str, int]:
        return await self._txn(ops.counts, read=True)

    # -- training ------------------------------------------------------------------------------------------------
    async def finished_groups(self, *, limit: int = 64, split: str = "train") -> list[FinishedGroup]:
        return await self._txn(ops.finished_groups, limit, split, self._finished, read=True)

    async def consume_groups(self, step: int, group_ids: list[str]) -> list[str]:
        return await self._txn(ops.consume_groups, step, group_ids)

    async def publish_version(self, version: PolicyVersion) -> None:
        await self._txn(ops.publish_version, version)

    async def current_version(self) -> PolicyVersion | None:
        return await self._single(ops.current_version)

    async def set_resource(self, resource: Resource) -> None:
        await self._txn(ops.set_resource, resource)

    async def get_resources(self) -> list[Resource]:
        return await self._txn(ops.get_resources, read=True)

    async def set_meta(self, key: str, value: Any) -> None:
        await self._txn(ops.set_meta, key, value)

    async def get_meta(self, key: str) -> Any | None:
        return await self._single(ops.get_meta, key)

    async def close(self) -> None:
        """Close every pool and the listener (idempotent); later calls raise ``StoreUnavailableError``. A pool of
        another event loop that still runs is closed on that loop; one of a loop that has stopped is dropped."""
        if self._closed:
            return
        self._closed = True
        current = asyncio.get_running_loop()
        listener, self._listener = self._listener, None
        if listener is not None and not listener.done():
            if listener.get_loop() is current:
                listener.cancel()
                with contextlib.suppress(asyncio.CancelledError, psycopg.Error):
                    await listener
            elif listener.get_loop().is_running():
                listener.get_loop().call_soon_threadsafe(listener.cancel)
        with self._lock:
            pools, self._pools = dict(self._pools), {}
        for loop, pool in pools.items():
            if loop is current:
                await pool.close()
            elif loop.is_running():
                with contextlib.suppress(RuntimeError):
                    asyncio.run_coroutine_threadsafe(pool.close(), loop)


def _attempts_in(result: Any) -> list[Attempt]:
    if isinstance(result, Attempt):
        return [result]
    if isinstance(result, Claim):
        return [result.attempt]
    if isinstance(result, list):
        return [a for a in result if isinstance(a, Attempt)]
    return []


def _translate(exc: psycopg.Error, url: str) -> StoreError:
    """psycopg errors as lightning_sdk errors (the caller raises it ``from exc``)."""
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, psycopg.OperationalError):  # connection refused or lost, pool timeout, server shutting down
        return StoreUnavailableError(f"store {_shown(url)}: {text}")
    if isinstance(exc, psycopg.IntegrityError):
        return StoreError(f"store {_shown(url)}: constraint violated ({text})")
    return StoreError(f"store {_shown(url)}: {text}")
