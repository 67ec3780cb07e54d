"""The SQLite schema of ``SQLiteStore`` and the conversions between its rows and the data model (no I/O).

Token ids are stored as little-endian int32 blobs and logprobs as little-endian float64 blobs: compact, and exact
(a float64 blob gives back the very same float). Everything else that is free-form (tasks, call request/response,
usage, meta) is compact JSON text written by orjson.
"""

from __future__ import annotations

import sqlite3
import struct
import sys
from array import array
from typing import Any

import orjson
from pydantic import BaseModel

from lightning_sdk.errors import ConfigError
from lightning_sdk.types import Attempt, AttemptStatus, Call, Group, Rollout, RolloutStatus

__all__ = [
    "ATTEMPT_COLS",
    "GROUP_COLS",
    "MIGRATE_1_TO_2",
    "ROLLOUT_COLS",
    "SCHEMA",
    "SCHEMA_VERSION",
    "attempt_from_row",
    "call_from_row",
    "call_to_row",
    "connect",
    "dumps",
    "group_from_row",
    "loads",
    "rollout_from_row",
]

SCHEMA_VERSION = 2
"""Version 2 added ``rollout_counts`` (rollouts per status, kept by triggers): a file of version 1 is migrated when
it is opened (``MIGRATE_1_TO_2``, one pass over its rollouts)."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS groups (
    seq           INTEGER PRIMARY KEY AUTOINCREMENT,
    group_id      TEXT NOT NULL UNIQUE,
    task          TEXT NOT NULL,            -- JSON object
    n             INTEGER NOT NULL,
    split         TEXT NOT NULL,
    created_at    REAL NOT NULL,
    consumed_step INTEGER                   -- NULL until a training step consumes the group
);
CREATE INDEX IF NOT EXISTS groups_unconsumed ON groups(split, seq) WHERE consumed_step IS NULL;

CREATE TABLE IF NOT EXISTS rollouts (
    seq           INTEGER PRIMARY KEY AUTOINCREMENT,  -- creation order; list cursors point at it
    rollout_id    TEXT NOT NULL UNIQUE,
    group_id      TEXT NOT NULL,
    task          TEXT,                     -- JSON object, NULL = the group's task
    split         TEXT NOT NULL,
    status        TEXT NOT NULL,
    max_attempts  INTEGER NOT NULL,
    attempts_used INTEGER NOT NULL,
    created_at    REAL NOT NULL,
    updated_at    REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS rollouts_status ON rollouts(status, seq);
CREATE INDEX IF NOT EXISTS rollouts_queue ON rollouts(split, seq) WHERE status = 'queued';
CREATE INDEX IF NOT EXISTS rollouts_group ON rollouts(group_id, seq);

CREATE TABLE IF NOT EXISTS attempts (
    attempt_id       TEXT PRIMARY KEY,
    rollout_id       TEXT NOT NULL,
    idx              INTEGER NOT NULL,
    token            TEXT NOT NULL UNIQUE,
    status           TEXT NOT NULL,
    worker_id        TEXT,
    error            TEXT,
    lease_expires_at REAL,
    started_at       REAL NOT NULL,
    ended_at         REAL,
    UNIQUE (rollout_id, idx)
);
CREATE INDEX IF NOT EXISTS attempts_running ON attempts(status) WHERE status = 'running';

CREATE TABLE IF NOT EXISTS calls (
    call_id        TEXT PRIMARY KEY,
    attempt_id     TEXT NOT NULL,
    rollout_id     TEXT NOT NULL,
    seq            INTEGER NOT NULL,
    started_at     REAL NOT NULL,
    prompt_ids     BLOB NOT NULL,           -- int32 little-endian
    completion_ids BLOB NOT NULL,           -- int32 little-endian
    logprobs       BLOB NOT NULL,           -- float64 little-endian
    body           TEXT NOT NULL            -- JSON of the other fields of Call
);
CREATE INDEX IF NOT EXISTS calls_attempt ON calls(attempt_id, seq, started_at);

CREATE TABLE IF NOT EXISTS rewards (
    attempt_id TEXT NOT NULL,
    name       TEXT NOT NULL,
    call_id    TEXT NOT NULL DEFAULT '',    -- '' = the attempt's final reward
    rollout_id TEXT NOT NULL,
    value      REAL NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (attempt_id, name, call_id)
);

-- Rollouts per status, kept by triggers in the transaction that moves a rollout, so ``counts()`` reads a few
-- rows instead of counting the whole table.
CREATE TABLE IF NOT EXISTS rollout_counts (status TEXT PRIMARY KEY, n INTEGER NOT NULL) WITHOUT ROWID;
CREATE TRIGGER IF NOT EXISTS rollout_counts_insert AFTER INSERT ON rollouts BEGIN
    INSERT INTO rollout_counts (status, n) VALUES (new.status, 1)
        ON CONFLICT (status) DO UPDATE SET n = n + 1;
END;
CREATE TRIGGER IF NOT EXISTS rollout_counts_update AFTER UPDATE OF status ON rollouts
    WHEN old.status IS NOT new.status BEGIN
    UPDATE rollout_counts SET n = n - 1 WHERE status = old.status;
    INSERT INTO rollout_counts (status, n) VALUES (new.status, 1)
        ON CONFLICT (status) DO UPDATE SET n = n + 1;
END;
CREATE TRIGGER IF NOT EXISTS rollout_counts_delete AFTER DELETE ON rollouts BEGIN
    UPDATE rollout_counts SET n = n - 1 WHERE status = old.status;
END;

CREATE TABLE IF NOT EXISTS versions (
    version    INTEGER PRIMARY KEY,
    step       INTEGER,
    created_at REAL NOT NULL,
    meta       TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS resources (name TEXT PRIMARY KEY, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

MIGRATE_1_TO_2 = """
DELETE FROM rollout_counts;
INSERT INTO rollout_counts (status, n) SELECT status, COUNT(*) FROM rollouts GROUP BY status;
"""
"""Run after ``SCHEMA`` (which creates the new table and its triggers) on a file of version 1."""

GROUP_COLS = "g.group_id, g.task, g.n, g.split, g.created_at, g.consumed_step"
ROLLOUT_COLS = (
    "r.rollout_id, r.group_id, COALESCE(r.task, g.task), r.split, r.status, r.max_attempts, r.attempts_used, "
    "r.created_at, r.updated_at"
)
ATTEMPT_COLS = "attempt_id, rollout_id, idx, token, status, worker_id, error, lease_expires_at, started_at, ended_at"

_BIG_ENDIAN = sys.byteorder == "big"


def dumps(value: Any, what: str) -> str:
    """Compact JSON text; ``ConfigError`` naming ``what`` if the value is not JSON."""
    try:
        return orjson.dumps(value).decode()
    except TypeError as exc:
        raise ConfigError(f"{what} is not JSON-serialisable: {exc}") from exc


def loads(text: str | bytes) -> Any:
    return orjson.loads(text)


def _pack(typecode: str, values: list[int] | list[float], call_id: str, field: str) -> bytes:
    """Little-endian bytes (``struct.pack`` is about twice as fast as ``array(...)`` from a list); ``ConfigError``
    naming the call's field when a value does not pack (the message is built only then: this runs for every call)."""
    try:
        return struct.pack(f"<{len(values)}{typecode}", *values)
    except struct.error as exc:
        raise ConfigError(f"call {call_id} {field}: {exc}") from exc


def _unpack(typecode: str, blob: bytes) -> array[Any]:
    arr = array(typecode)
    arr.frombytes(blob)
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr


def group_from_row(row: tuple[Any, ...]) -> Group:
    return Group(group_id=row[0], task=loads(row[1]), n=row[2], split=row[3], created_at=row[4], consumed_step=row[5])


def rollout_from_row(row: tuple[Any, ...]) -> Rollout:
    return Rollout(
        rollout_id=row[0],
        group_id=row[1],
        task=loads(row[2]),
        split=row[3],
        status=RolloutStatus(row[4]),
        max_attempts=row[5],
        attempts_used=row[6],
        created_at=row[7],
        updated_at=row[8],
    )


def attempt_from_row(row: tuple[Any, ...]) -> Attempt:
    return Attempt(
        attempt_id=row[0],
        rollout_id=row[1],
        index=row[2],
        token=row[3],
        status=AttemptStatus(row[4]),
        worker_id=row[5],
        error=row[6],
        lease_expires_at=row[7],
        started_at=row[8],
        ended_at=row[9],
    )


def call_to_row(call: Call) -> tuple[Any, ...]:
    """(call_id, attempt_id, rollout_id, seq, started_at, prompt_ids, completion_ids, logprobs, body).

    The body is the JSON of the call's other fields read straight off the model's ``__dict__`` (its fields, in
    declaration order: what ``model_dump`` gives; they hold JSON values only: scalars, and dicts of JSON), not
    through ``model_dump``, which copies every nested dict first: that copy was half of the writer thread's CPU
    per recorded call. The store's writer thread runs this for every call while holding the GIL the proxy's event
    loop needs (4.2 -> 3.2 us a call with the dict copy and no per-call message strings).
    """
    body = dict(call.__dict__)
    prompt_ids, completion_ids, logprobs = body.pop("prompt_ids"), body.pop("completion_ids"), body.pop("logprobs")
    try:
        text = orjson.dumps(body, default=_jsonable).decode()
    except TypeError as exc:
        raise ConfigError(f"call {call.call_id} is not JSON-serialisable: {exc}") from exc
    call_id = call.call_id
    return (
        call_id,
        call.attempt_id,
        call.rollout_id,
        call.seq,
        call.started_at,
        _pack("i", prompt_ids, call_id, "prompt_ids"),
        _pack("i", completion_ids, call_id, "completion_ids"),
        _pack("d", logprobs, call_id, "logprobs"),
        text,
    )


def _jsonable(value: Any) -> Any:
    """What ``model_dump`` would have made of a model nested in a call's free-form fields."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    raise TypeError(f"Type is not JSON serializable: {type(value).__name__}")


def call_from_row(row: tuple[Any, ...]) -> Call:
    """From (prompt_ids, completion_ids, logprobs, body[, seq]): the ``seq`` column wins over the body's (a re-sent
    call's row keeps the first's number: ``lc.split_resent``)."""
    data = loads(row[3])
    if len(row) > 4:
        data["seq"] = row[4]
    data["prompt_ids"] = _unpack("i", row[0]).tolist()
    data["completion_ids"] = _unpack("i", row[1]).tolist()
    data["logprobs"] = _unpack("d", row[2]).tolist()
    return Call.model_validate(data)


PAGE_SIZE = 16384
"""The page size of a new store file. A recorded call is a ~1-10 KB row (its ids, log-probs and JSON body): with
SQLite's default 4 KB pages two or fewer fit a page, and committing them cost ~8 us of the store's writer thread per
call (WAL frames, page splits, checkpoints); with 16 KB pages ~3 us (and the insert 2.7 -> 2.1 us), measured with
256-call batches of the proxy's benchmark calls. A file made before keeps its page size (SQLite fixes it when the
first table is created)."""


def connect(path: str, *, synchronous: str, busy_timeout_s: float, readonly: bool) -> sqlite3.Connection:
    """A connection in WAL mode with the given ``synchronous`` level, used from one thread at a time."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=busy_timeout_s)
    conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
    if not readonly:
        conn.execute(f"PRAGMA page_size = {PAGE_SIZE}")  # takes effect on a new file only: before WAL fixes it
        conn.execute("PRAGMA journal_mode = WAL")
    conn.execute(f"PRAGMA synchronous = {synchronous}")
    if readonly:
        conn.execute("PRAGMA query_only = ON")
    return conn
