"""The operations of ``SQLiteStore`` as plain functions of a connection, run inside one transaction each.

``SQLiteStore`` opens the transaction on its writer or reader thread and calls one of these; lifecycle moves are
computed by ``_lifecycle`` from the rows read here, then written back.
"""

from __future__ import annotations

import itertools
import sqlite3
from collections.abc import Iterator
from typing import Any

from lightning_sdk.errors import NotFoundError
from lightning_sdk.store import _lifecycle as lc
from lightning_sdk.store._sqlite_rows import (
    ATTEMPT_COLS,
    GROUP_COLS,
    ROLLOUT_COLS,
    attempt_from_row,
    call_from_row,
    call_to_row,
    dumps,
    group_from_row,
    loads,
    rollout_from_row,
)
from lightning_sdk.types import (
    Attempt,
    AttemptDetail,
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

Conn = sqlite3.Connection
_CHUNK = 500  # ids per IN (...) list, well under SQLite's parameter limit
_UNFINISHED = "('queued', 'running')"


def _chunks(ids: list[str]) -> Iterator[list[str]]:
    for i in range(0, len(ids), _CHUNK):
        yield ids[i : i + _CHUNK]


def _marks(ids: list[str]) -> str:
    return ",".join("?" * len(ids))


# -- reads of single objects ---------------------------------------------------------------------------------------
def _rollout(conn: Conn, rollout_id: str) -> Rollout:
    row = conn.execute(
        f"SELECT {ROLLOUT_COLS} FROM rollouts r JOIN groups g ON g.group_id = r.group_id WHERE r.rollout_id = ?",
        (rollout_id,),
    ).fetchone()
    if row is None:
        raise NotFoundError(f"no rollout {rollout_id!r}")
    return rollout_from_row(row)


def get_attempt(conn: Conn, attempt_id: str) -> Attempt:
    row = conn.execute(f"SELECT {ATTEMPT_COLS} FROM attempts WHERE attempt_id = ?", (attempt_id,)).fetchone()
    if row is None:
        raise NotFoundError(f"no attempt {attempt_id!r}")
    return attempt_from_row(row)


def attempt_by_token(conn: Conn, token: str) -> Attempt | None:
    row = conn.execute(f"SELECT {ATTEMPT_COLS} FROM attempts WHERE token = ?", (token,)).fetchone()
    return None if row is None else attempt_from_row(row)


def running_attempts(conn: Conn) -> list[Attempt]:
    cur = conn.execute(f"SELECT {ATTEMPT_COLS} FROM attempts WHERE status = 'running'")
    return [attempt_from_row(r) for r in cur]


def _group(conn: Conn, group_id: str) -> Group | None:
    row = conn.execute(f"SELECT {GROUP_COLS} FROM groups g WHERE g.group_id = ?", (group_id,)).fetchone()
    return None if row is None else group_from_row(row)


# -- writes of single objects --------------------------------------------------------------------------------------
def _insert_group(conn: Conn, group: Group) -> None:
    conn.execute(
        "INSERT INTO groups (group_id, task, n, split, created_at, consumed_step) VALUES (?, ?, ?, ?, ?, ?)",
        (group.group_id, dumps(group.task, "task"), group.n, group.split, group.created_at, group.consumed_step),
    )


def _insert_rollouts(conn: Conn, rollouts: list[Rollout], own_task: bool = False) -> None:
    conn.executemany(
        "INSERT INTO rollouts (rollout_id, group_id, task, split, status, max_attempts, attempts_used, created_at, "
        "updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [
            (
                r.rollout_id,
                r.group_id,
                dumps(r.task, "task") if own_task else None,
                r.split,
                r.status.value,
                r.max_attempts,
                r.attempts_used,
                r.created_at,
                r.updated_at,
            )
            for r in rollouts
        ],
    )


def _update_rollout(conn: Conn, r: Rollout) -> None:
    conn.execute(
        "UPDATE rollouts SET status = ?, attempts_used = ?, updated_at = ? WHERE rollout_id = ?",
        (r.status.value, r.attempts_used, r.updated_at, r.rollout_id),
    )


def _insert_attempt(conn: Conn, a: Attempt) -> None:
    conn.execute(
        f"INSERT INTO attempts ({ATTEMPT_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            a.attempt_id,
            a.rollout_id,
            a.index,
            a.token,
            a.status.value,
            a.worker_id,
            a.error,
            a.lease_expires_at,
            a.started_at,
            a.ended_at,
        ),
    )


def _update_attempt(conn: Conn, a: Attempt) -> None:
    conn.execute(
        "UPDATE attempts SET status = ?, error = ?, lease_expires_at = ?, ended_at = ? WHERE attempt_id = ?",
        (a.status.value, a.error, a.lease_expires_at, a.ended_at, a.attempt_id),
    )


# -- tasks, groups, rollouts ---------------------------------------------------------------------------------------
def enqueue(
    conn: Conn, tasks: list[Task], n: int, max_attempts: int, split: str, group_ids: list[str] | None, ts: float
) -> list[Group]:
    lc.validate_enqueue(tasks, n, max_attempts, split, group_ids)
    out: list[Group] = []
    for i, task in enumerate(tasks):
        gid = group_ids[i] if group_ids is not None else None
        existing = _group(conn, gid) if gid is not None else None
        if existing is not None:
            out.append(existing)
            continue
        group = lc.new_group(task, n, split, gid, ts)
        _insert_group(conn, group)
        _insert_rollouts(conn, lc.new_rollouts(group, n, max_attempts, ts))
        out.append(group)
    return out


def open_session(conn: Conn, task: Task | None, group_id: str | None, ts: float, split: str = "train") -> Claim:
    group = _group(conn, group_id) if group_id is not None else None
    if group is None:
        group = lc.new_group(task or {}, 1, split, group_id, ts)
        _insert_group(conn, group)
    else:
        group = lc.join_group(group)
        conn.execute("UPDATE groups SET n = ? WHERE group_id = ?", (group.n, group.group_id))
    rollout, attempt = lc.open_session_objects(group, ts)
    if task is not None:
        rollout = rollout.model_copy(update={"task": task})
    _insert_rollouts(conn, [rollout], own_task=task is not None)
    _insert_attempt(conn, attempt)
    return Claim(rollout=rollout, attempt=attempt)


def claim(conn: Conn, worker_id: str, lease_s: float, split: str | None, ts: float) -> Claim | None:
    lc.check_lease_s(lease_s, "claim")
    where = "r.status = 'queued'" + (" AND r.split = ?" if split is not None else "")
    row = conn.execute(
        f"SELECT {ROLLOUT_COLS} FROM rollouts r JOIN groups g ON g.group_id = r.group_id WHERE {where} "
        "ORDER BY r.seq LIMIT 1",
        (split,) if split is not None else (),
    ).fetchone()
    if row is None:
        return None
    rollout = rollout_from_row(row)
    (index,) = conn.execute("SELECT COUNT(*) FROM attempts WHERE rollout_id = ?", (rollout.rollout_id,)).fetchone()
    new_rollout, attempt = lc.start_attempt(rollout, index, worker_id, ts + lease_s, ts)
    _update_rollout(conn, new_rollout)
    _insert_attempt(conn, attempt)
    return Claim(rollout=new_rollout, attempt=attempt)


def heartbeat(conn: Conn, attempt_id: str, lease_s: float, ts: float) -> Attempt:
    attempt = lc.extend_lease(get_attempt(conn, attempt_id), lease_s, ts)
    _update_attempt(conn, attempt)
    return attempt


def _end(conn: Conn, attempt: Attempt, status: AttemptStatus, error: str | None, ts: float) -> Attempt:
    rollout, new_attempt = lc.end_attempt(_rollout(conn, attempt.rollout_id), attempt, status, error, ts)
    _update_rollout(conn, rollout)
    _update_attempt(conn, new_attempt)
    return new_attempt


def finish(conn: Conn, attempt_id: str, status: AttemptStatus, error: str | None, ts: float) -> Attempt:
    return _end(conn, get_attempt(conn, attempt_id), status, error, ts)


def expire(conn: Conn, ts: float) -> list[Attempt]:
    cur = conn.execute(
        f"SELECT {ATTEMPT_COLS} FROM attempts WHERE status = 'running' AND lease_expires_at IS NOT NULL "
        "AND lease_expires_at <= ? ORDER BY lease_expires_at",
        (ts,),
    )
    expired = [attempt_from_row(r) for r in cur.fetchall()]
    return [_end(conn, a, AttemptStatus.TIMED_OUT, lc.LEASE_EXPIRED, ts) for a in expired if lc.lease_expired(a, ts)]


def cancel(conn: Conn, rollout_id: str, ts: float) -> Rollout:
    rollout = lc.cancel(_rollout(conn, rollout_id), ts)
    _update_rollout(conn, rollout)
    return rollout


# -- calls and rewards ---------------------------------------------------------------------------------------------
def _check_owners(conn: Conn, pairs: set[tuple[str, str]], what: str) -> None:
    """Every (attempt_id, rollout_id) must name an existing attempt of that rollout."""
    owners: dict[str, str] = {}
    attempt_ids = sorted({a for a, _ in pairs})
    for chunk in _chunks(attempt_ids):
        cur = conn.execute(f"SELECT attempt_id, rollout_id FROM attempts WHERE attempt_id IN ({_marks(chunk)})", chunk)
        owners.update(cur.fetchall())
    for attempt_id, rollout_id in sorted(pairs):
        lc.check_owner(what, attempt_id, rollout_id, owners.get(attempt_id))


_CALL_ROWS = (
    "calls (call_id, attempt_id, rollout_id, seq, started_at, prompt_ids, completion_ids, logprobs, body) VALUES "
)
_REPLACE = (
    " ON CONFLICT (call_id) DO UPDATE SET started_at = excluded.started_at, prompt_ids = excluded.prompt_ids, "
    "completion_ids = excluded.completion_ids, logprobs = excluded.logprobs, body = excluded.body"
)
"""A re-sent call (``Call.idempotency_key``) replaces the stored call of its id, keeping the stored ``seq``."""
_CALLS_PER_INSERT = 100  # 9 parameters a row: 900, under SQLite's oldest limit of 999


def record_calls(conn: Conn, calls: list[Call]) -> None:
    """Insert the calls (a call id already stored is left as it is, unless the call was re-sent:
    ``lc.split_resent``), up to ``_CALLS_PER_INSERT`` rows per statement: the sqlite3 module releases the GIL around
    every ``sqlite3_step`` and ``executemany`` steps once per row, so the writer thread and the proxy's event loop,
    running at once on two cores, handed the GIL to each other once per recorded call; a multi-row ``INSERT`` steps
    once per statement."""
    _check_owners(conn, {(c.attempt_id, c.rollout_id) for c in calls}, "record_calls")
    plain, resent = lc.split_resent(calls)
    for batch, verb, upsert in ((plain, "INSERT OR IGNORE INTO ", ""), (resent, "INSERT INTO ", _REPLACE)):
        rows = [call_to_row(c) for c in batch]
        for i in range(0, len(rows), _CALLS_PER_INSERT):
            chunk = rows[i : i + _CALLS_PER_INSERT]
            values = ",".join(["(?,?,?,?,?,?,?,?,?)"] * len(chunk))
            conn.execute(verb + _CALL_ROWS + values + upsert, list(itertools.chain.from_iterable(chunk)))


def record_rewards(conn: Conn, rewards: list[Reward]) -> None:
    _check_owners(conn, {(r.attempt_id, r.rollout_id) for r in rewards}, "record_rewards")
    conn.executemany(
        "INSERT OR REPLACE INTO rewards (attempt_id, name, call_id, rollout_id, value, created_at) "
        "VALUES (?, ?, ?, ?, ?, ?)",
        [(r.attempt_id, r.name, r.call_id or "", r.rollout_id, r.value, r.created_at) for r in rewards],
    )


# -- reading -------------------------------------------------------------------------------------------------------
def _details(conn: Conn, rollouts: list[Rollout]) -> list[RolloutDetail]:
    """The attempts, calls and rewards of ``rollouts`` (a few bulk queries, not one per object)."""
    attempts: dict[str, list[Attempt]] = {}
    for chunk in _chunks([r.rollout_id for r in rollouts]):
        cur = conn.execute(f"SELECT {ATTEMPT_COLS} FROM attempts WHERE rollout_id IN ({_marks(chunk)})", chunk)
        for row in cur:
            a = attempt_from_row(row)
            attempts.setdefault(a.rollout_id, []).append(a)
    attempt_ids = [a.attempt_id for lst in attempts.values() for a in lst]
    calls: dict[str, list[Call]] = {}
    rewards: dict[str, list[Reward]] = {}
    for chunk in _chunks(attempt_ids):
        cur = conn.execute(
            f"SELECT attempt_id, prompt_ids, completion_ids, logprobs, body, seq FROM calls "
            f"WHERE attempt_id IN ({_marks(chunk)}) ORDER BY attempt_id, seq, started_at",
            chunk,
        )
        for row in cur:
            calls.setdefault(row[0], []).append(call_from_row(row[1:]))
        cur = conn.execute(
            f"SELECT attempt_id, rollout_id, name, call_id, value, created_at FROM rewards "
            f"WHERE attempt_id IN ({_marks(chunk)}) ORDER BY created_at",
            chunk,
        )
        for row in cur:
            rewards.setdefault(row[0], []).append(
                Reward(
                    attempt_id=row[0],
                    rollout_id=row[1],
                    name=row[2],
                    call_id=row[3] or None,
                    value=row[4],
                    created_at=row[5],
                )
            )
    out = []
    for r in rollouts:
        mine = sorted(attempts.get(r.rollout_id, []), key=lambda a: a.index)
        out.append(
            RolloutDetail(
                rollout=r,
                attempts=[
                    AttemptDetail(attempt=a, calls=calls.get(a.attempt_id, []), rewards=rewards.get(a.attempt_id, []))
                    for a in mine
                ],
            )
        )
    return out


def get_rollout(conn: Conn, rollout_id: str) -> RolloutDetail:
    (detail,) = _details(conn, [_rollout(conn, rollout_id)])
    return detail


def list_rollouts(
    conn: Conn, status: RolloutStatus | None, limit: int, after: str | None
) -> tuple[list[Rollout], str | None]:
    lc.check_limit(limit, "list_rollouts")
    start = lc.decode_cursor(after)
    where = "r.seq > ?"
    args: list[Any] = [start]
    if status is not None:
        where += " AND r.status = ?"
        args.append(RolloutStatus(status).value)
    rows = conn.execute(
        f"SELECT r.seq, {ROLLOUT_COLS} FROM rollouts r JOIN groups g ON g.group_id = r.group_id WHERE {where} "
        "ORDER BY r.seq LIMIT ?",
        (*args, limit + 1),
    ).fetchall()
    page = [rollout_from_row(row[1:]) for row in rows[:limit]]
    return page, (lc.encode_cursor(rows[limit - 1][0]) if len(rows) > limit else None)


def list_rollout_details(conn: Conn, limit: int, after: str | None) -> tuple[list[RolloutDetail], str | None]:
    page, nxt = list_rollouts(conn, None, limit, after)
    return _details(conn, page), nxt


_READY = (
    f"FROM groups g WHERE g.split = ? AND g.consumed_step IS NULL "
    f"AND EXISTS (SELECT 1 FROM rollouts r WHERE r.group_id = g.group_id) "
    f"AND NOT EXISTS (SELECT 1 FROM rollouts r WHERE r.group_id = g.group_id AND r.status IN {_UNFINISHED})"
)


def counts(conn: Conn) -> dict[str, int]:
    out = dict.fromkeys(lc.ROLLOUT_STATUSES, 0)
    for status, count in conn.execute("SELECT status, n FROM rollout_counts"):  # kept by triggers (schema)
        out[status] = count
    (out["groups_ready"],) = conn.execute(f"SELECT COUNT(*) {_READY}", ("train",)).fetchone()
    return out


def finished_groups(conn: Conn, limit: int, split: str, cache: lc.FinishedCache | None = None) -> list[FinishedGroup]:
    groups = [
        group_from_row(r) for r in conn.execute(f"SELECT {GROUP_COLS} {_READY} ORDER BY g.seq LIMIT ?", (split, limit))
    ]
    if cache is None:
        return _with_rollouts(conn, groups)
    known, missing = cache.lookup(groups)
    return cache.answer(split, groups, known, _with_rollouts(conn, missing))


def list_group_details(
    conn: Conn, split: str | None, limit: int, after: str | None
) -> tuple[list[FinishedGroup], str | None]:
    lc.check_limit(limit, "list_group_details")
    where = "g.seq > ?"
    args: list[Any] = [lc.decode_cursor(after)]
    if split is not None:
        where += " AND g.split = ?"
        args.append(split)
    rows = conn.execute(
        f"SELECT g.seq, {GROUP_COLS} FROM groups g WHERE {where} ORDER BY g.seq LIMIT ?", (*args, limit + 1)
    ).fetchall()
    page = _with_rollouts(conn, [group_from_row(row[1:]) for row in rows[:limit]])
    return page, (lc.encode_cursor(rows[limit - 1][0]) if len(rows) > limit else None)


def _with_rollouts(conn: Conn, groups: list[Group]) -> list[FinishedGroup]:
    """Each group with the details of its rollouts in creation order (a few bulk queries)."""
    by_group: dict[str, list[Rollout]] = {}
    for chunk in _chunks([g.group_id for g in groups]):
        cur = conn.execute(
            f"SELECT {ROLLOUT_COLS} FROM rollouts r JOIN groups g ON g.group_id = r.group_id "
            f"WHERE r.group_id IN ({_marks(chunk)}) ORDER BY r.seq",
            chunk,
        )
        for row in cur:
            rollout = rollout_from_row(row)
            by_group.setdefault(rollout.group_id, []).append(rollout)
    details = {d.rollout.rollout_id: d for d in _details(conn, [r for lst in by_group.values() for r in lst])}
    return [FinishedGroup(g, [details[r.rollout_id] for r in by_group.get(g.group_id, [])]) for g in groups]


def consume_groups(conn: Conn, step: int, group_ids: list[str]) -> list[str]:
    fresh: list[str] = []
    for gid in group_ids:
        statuses = [RolloutStatus(s) for (s,) in conn.execute("SELECT status FROM rollouts WHERE group_id = ?", (gid,))]
        if lc.check_consumable(gid, _group(conn, gid), statuses, step) and gid not in fresh:
            fresh.append(gid)
    conn.executemany("UPDATE groups SET consumed_step = ? WHERE group_id = ?", [(step, gid) for gid in fresh])
    return fresh


def publish_version(conn: Conn, v: PolicyVersion) -> None:
    conn.execute(
        "INSERT OR REPLACE INTO versions (version, step, created_at, meta) VALUES (?, ?, ?, ?)",
        (v.version, v.step, v.created_at, dumps(v.meta, "version meta")),
    )


def current_version(conn: Conn) -> PolicyVersion | None:
    row = conn.execute("SELECT version, step, created_at, meta FROM versions ORDER BY version DESC LIMIT 1").fetchone()
    if row is None:
        return None
    return PolicyVersion(version=row[0], step=row[1], created_at=row[2], meta=loads(row[3]))


def set_resource(conn: Conn, resource: Resource) -> None:
    conn.execute(
        "INSERT OR REPLACE INTO resources (name, body) VALUES (?, ?)",
        (resource.name, dumps(resource.model_dump(mode="json"), "resource")),
    )


def get_resources(conn: Conn) -> list[Resource]:
    return [Resource.model_validate(loads(b)) for (b,) in conn.execute("SELECT body FROM resources ORDER BY name")]


def set_meta(conn: Conn, key: str, value: Any) -> None:
    conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, dumps(value, f"meta {key!r}")))


def get_meta(conn: Conn, key: str) -> Any | None:
    row = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    return None if row is None else loads(row[0])
