"""The schema of ``PostgresStore`` and its operations as plain async functions of a cursor, one transaction each.

``PostgresStore`` opens the transaction (and retries it on a deadlock or serialization failure); lifecycle moves
are computed by ``_lifecycle`` from the rows read here, then written back. Rows use the codec of the SQLite store
(``_sqlite_rows``: token ids as little-endian int32 bytes, log-probs as float64 bytes, free-form fields as JSON
text), so a call reads back bit for bit the same from either store.

Concurrency (several processes on one database). Every move locks the rows it reads before it decides:

* ``claim`` takes the oldest queued rollout ``FOR UPDATE SKIP LOCKED``: concurrent claimers get distinct rollouts
  and never wait on each other;
* a move of an attempt locks the attempt, then its rollout (always in that order; a claim locks only the rollout
  and inserts the attempt), so a finish, a heartbeat, an expiry and a call record of one attempt serialise;
* ``expire`` takes the expired attempts ``FOR UPDATE SKIP LOCKED`` (two reapers expire disjoint sets);
* ``record_calls`` with ``running_only`` (the proxies' barrier, docs/scale-out.md) locks the attempts it records
  for ``FOR SHARE``: a finish (``FOR UPDATE``) waits for the batches in flight and every batch after it sees the
  attempt ended and is refused, so no call lands after a finish and a finish counts every call that landed.
"""

from __future__ import annotations

from typing import Any

from psycopg import AsyncCursor

from lightning_sdk.errors import AttemptNotRunningError, NotFoundError
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

Cur = AsyncCursor[Any]

SCHEMA_VERSION = 1
"""The version written in ``schema_version``; ``MIGRATIONS[v]`` moves a database of version ``v`` to ``v + 1``."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS groups (
    seq           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    group_id      TEXT NOT NULL UNIQUE,
    task          TEXT NOT NULL,
    n             INTEGER NOT NULL,
    split         TEXT NOT NULL,
    created_at    DOUBLE PRECISION NOT NULL,
    consumed_step BIGINT
);
CREATE INDEX IF NOT EXISTS groups_unconsumed ON groups (split, seq) WHERE consumed_step IS NULL;

CREATE TABLE IF NOT EXISTS rollouts (
    seq           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    rollout_id    TEXT NOT NULL UNIQUE,
    group_id      TEXT NOT NULL,
    task          TEXT,
    split         TEXT NOT NULL,
    status        TEXT NOT NULL,
    max_attempts  INTEGER NOT NULL,
    attempts_used INTEGER NOT NULL,
    created_at    DOUBLE PRECISION NOT NULL,
    updated_at    DOUBLE PRECISION NOT NULL
);
CREATE INDEX IF NOT EXISTS rollouts_status ON rollouts (status, seq);
CREATE INDEX IF NOT EXISTS rollouts_queue ON rollouts (split, seq) WHERE status = 'queued';
CREATE INDEX IF NOT EXISTS rollouts_group ON rollouts (group_id, seq);
CREATE INDEX IF NOT EXISTS rollouts_unfinished ON rollouts (group_id) WHERE status IN ('queued', 'running');

CREATE TABLE IF NOT EXISTS attempts (
    attempt_id       TEXT PRIMARY KEY,
    rollout_id       TEXT NOT NULL,
    idx              INTEGER NOT NULL,
    token            TEXT NOT NULL UNIQUE,
    status           TEXT NOT NULL,
    worker_id        TEXT,
    error            TEXT,
    lease_expires_at DOUBLE PRECISION,
    started_at       DOUBLE PRECISION NOT NULL,
    ended_at         DOUBLE PRECISION,
    next_seq         BIGINT NOT NULL DEFAULT 0,   -- the proxies' call numbering (reserve_seq)
    UNIQUE (rollout_id, idx)
);
CREATE INDEX IF NOT EXISTS attempts_running ON attempts (lease_expires_at) WHERE status = 'running';

CREATE TABLE IF NOT EXISTS calls (
    call_id        TEXT PRIMARY KEY,
    attempt_id     TEXT NOT NULL,
    rollout_id     TEXT NOT NULL,
    seq            INTEGER NOT NULL,
    started_at     DOUBLE PRECISION NOT NULL,
    prompt_ids     BYTEA NOT NULL,
    completion_ids BYTEA NOT NULL,
    logprobs       BYTEA NOT NULL,
    body           TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS calls_attempt ON calls (attempt_id, seq, started_at);

CREATE TABLE IF NOT EXISTS rewards (
    attempt_id TEXT NOT NULL,
    name       TEXT NOT NULL,
    call_id    TEXT NOT NULL DEFAULT '',
    rollout_id TEXT NOT NULL,
    value      DOUBLE PRECISION NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (attempt_id, name, call_id)
);

CREATE TABLE IF NOT EXISTS versions (
    version    BIGINT PRIMARY KEY,
    step       BIGINT,
    created_at DOUBLE PRECISION NOT NULL,
    meta       TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS resources (name TEXT PRIMARY KEY, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

MIGRATIONS: dict[int, str] = {}
"""``MIGRATIONS[v]``: the statements that move a database of schema version ``v`` to ``v + 1`` (none yet)."""

NOTIFY_CHANNEL = "lightning_sdk_attempt_ends"  # NOTIFY'd in the transaction that ends attempts (store/_events.py)
_UNFINISHED = "('queued', 'running')"


async def _notify_ends(cur: Cur) -> None:
    await cur.execute("SELECT pg_notify(%s, '')", (NOTIFY_CHANNEL,))


# -- reads of single objects ---------------------------------------------------------------------------------------
async def _rollout(cur: Cur, rollout_id: str, lock: bool = False) -> Rollout:
    await cur.execute(
        f"SELECT {ROLLOUT_COLS} FROM rollouts r JOIN groups g ON g.group_id = r.group_id WHERE r.rollout_id = %s"
        + (" FOR UPDATE OF r" if lock else ""),
        (rollout_id,),
    )
    row = await cur.fetchone()
    if row is None:
        raise NotFoundError(f"no rollout {rollout_id!r}")
    return rollout_from_row(row)


async def _attempt(cur: Cur, attempt_id: str, lock: bool = False) -> Attempt:
    await cur.execute(
        f"SELECT {ATTEMPT_COLS} FROM attempts WHERE attempt_id = %s" + (" FOR UPDATE" if lock else ""), (attempt_id,)
    )
    row = await cur.fetchone()
    if row is None:
        raise NotFoundError(f"no attempt {attempt_id!r}")
    return attempt_from_row(row)


async def get_attempt(cur: Cur, attempt_id: str) -> Attempt:
    return await _attempt(cur, attempt_id)


async def attempt_by_token(cur: Cur, token: str) -> Attempt | None:
    await cur.execute(f"SELECT {ATTEMPT_COLS} FROM attempts WHERE token = %s", (token,))
    row = await cur.fetchone()
    return None if row is None else attempt_from_row(row)


async def _group(cur: Cur, group_id: str, lock: bool = False) -> Group | None:
    await cur.execute(
        f"SELECT {GROUP_COLS} FROM groups g WHERE g.group_id = %s" + (" FOR UPDATE" if lock else ""), (group_id,)
    )
    row = await cur.fetchone()
    return None if row is None else group_from_row(row)


# -- writes of single objects --------------------------------------------------------------------------------------
async def _insert_group(cur: Cur, group: Group) -> bool:
    """Insert ``group``; False if a group of that id exists already (another writer made it)."""
    await cur.execute(
        "INSERT INTO groups (group_id, task, n, split, created_at, consumed_step) VALUES (%s, %s, %s, %s, %s, %s) "
        "ON CONFLICT (group_id) DO NOTHING RETURNING seq",
        (group.group_id, dumps(group.task, "task"), group.n, group.split, group.created_at, group.consumed_step),
    )
    return await cur.fetchone() is not None


async def _insert_rollouts(cur: Cur, rollouts: list[Rollout], own_task: bool = False) -> None:
    await cur.executemany(
        "INSERT INTO rollouts (rollout_id, group_id, task, split, status, max_attempts, attempts_used, created_at, "
        "updated_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)",
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


async def _update_rollout(cur: Cur, r: Rollout) -> None:
    await cur.execute(
        "UPDATE rollouts SET status = %s, attempts_used = %s, updated_at = %s WHERE rollout_id = %s",
        (r.status.value, r.attempts_used, r.updated_at, r.rollout_id),
    )


async def _insert_attempt(cur: Cur, a: Attempt) -> None:
    await cur.execute(
        f"INSERT INTO attempts ({ATTEMPT_COLS}) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
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


async def _update_attempt(cur: Cur, a: Attempt) -> None:
    await cur.execute(
        "UPDATE attempts SET status = %s, error = %s, lease_expires_at = %s, ended_at = %s WHERE attempt_id = %s",
        (a.status.value, a.error, a.lease_expires_at, a.ended_at, a.attempt_id),
    )


# -- tasks, groups, rollouts ---------------------------------------------------------------------------------------
async def enqueue(
    cur: Cur, tasks: list[Task], n: int, max_attempts: int, split: str, group_ids: list[str] | None, ts: float
) -> list[Group]:
    lc.validate_enqueue(tasks, n, max_attempts, split, group_ids)
    out: list[Group] = []
    for i, task in enumerate(tasks):
        gid = group_ids[i] if group_ids is not None else None
        group = lc.new_group(task, n, split, gid, ts)
        if not await _insert_group(cur, group):  # idempotent on the client's group id
            existing = await _group(cur, group.group_id)
            assert existing is not None  # the insert conflicted on it
            out.append(existing)
            continue
        await _insert_rollouts(cur, lc.new_rollouts(group, n, max_attempts, ts))
        out.append(group)
    return out


async def open_session(cur: Cur, task: Task | None, group_id: str | None, ts: float, split: str = "train") -> Claim:
    fresh = lc.new_group(task or {}, 1, split, group_id, ts)
    if await _insert_group(cur, fresh):
        group = fresh
    else:
        existing = await _group(cur, fresh.group_id, lock=True)
        assert existing is not None  # the insert conflicted on it
        group = lc.join_group(existing)
        await cur.execute("UPDATE groups SET n = %s WHERE group_id = %s", (group.n, group.group_id))
    rollout, attempt = lc.open_session_objects(group, ts)
    if task is not None:
        rollout = rollout.model_copy(update={"task": task})
    await _insert_rollouts(cur, [rollout], own_task=task is not None)
    await _insert_attempt(cur, attempt)
    return Claim(rollout=rollout, attempt=attempt)


async def claim(cur: Cur, worker_id: str, lease_s: float, split: str | None, ts: float) -> Claim | None:
    lc.check_lease_s(lease_s, "claim")
    where = "r.status = 'queued'" + (" AND r.split = %s" if split is not None else "")
    await cur.execute(
        f"SELECT {ROLLOUT_COLS} FROM rollouts r JOIN groups g ON g.group_id = r.group_id WHERE {where} "
        "ORDER BY r.seq LIMIT 1 FOR UPDATE OF r SKIP LOCKED",
        (split,) if split is not None else (),
    )
    row = await cur.fetchone()
    if row is None:
        return None
    rollout = rollout_from_row(row)
    await cur.execute("SELECT COUNT(*) FROM attempts WHERE rollout_id = %s", (rollout.rollout_id,))
    (index,) = await cur.fetchone() or (0,)
    new_rollout, attempt = lc.start_attempt(rollout, index, worker_id, ts + lease_s, ts)
    await _update_rollout(cur, new_rollout)
    await _insert_attempt(cur, attempt)
    return Claim(rollout=new_rollout, attempt=attempt)


async def heartbeat(cur: Cur, attempt_id: str, lease_s: float, ts: float) -> Attempt:
    attempt = lc.extend_lease(await _attempt(cur, attempt_id, lock=True), lease_s, ts)
    await _update_attempt(cur, attempt)
    return attempt


async def _end(cur: Cur, attempt: Attempt, status: AttemptStatus, error: str | None, ts: float) -> Attempt:
    """End a locked attempt (its rollout is locked here, after it)."""
    rollout = await _rollout(cur, attempt.rollout_id, lock=True)
    rollout, new_attempt = lc.end_attempt(rollout, attempt, status, error, ts)
    await _update_rollout(cur, rollout)
    await _update_attempt(cur, new_attempt)
    return new_attempt


async def finish(cur: Cur, attempt_id: str, status: AttemptStatus, error: str | None, ts: float) -> Attempt:
    ended = await _end(cur, await _attempt(cur, attempt_id, lock=True), status, error, ts)
    await _notify_ends(cur)
    return ended


async def finish_counting(
    cur: Cur, attempt_id: str, status: AttemptStatus, error: str | None, ts: float
) -> tuple[Attempt, int]:
    """``finish`` and the number of calls the attempt has in the store, counted under the attempt's exclusive lock:
    every batch that holds its share lock has committed, and none can land after."""
    ended = await finish(cur, attempt_id, status, error, ts)
    await cur.execute("SELECT COUNT(*) FROM calls WHERE attempt_id = %s", (attempt_id,))
    row = await cur.fetchone()
    return ended, int(row[0]) if row else 0


async def expire(cur: Cur, ts: float) -> list[Attempt]:
    await cur.execute(
        f"SELECT {ATTEMPT_COLS} FROM attempts WHERE status = 'running' AND lease_expires_at IS NOT NULL "
        "AND lease_expires_at <= %s ORDER BY lease_expires_at FOR UPDATE SKIP LOCKED",
        (ts,),
    )
    expired = [attempt_from_row(r) for r in await cur.fetchall()]
    out = [
        await _end(cur, a, AttemptStatus.TIMED_OUT, lc.LEASE_EXPIRED, ts) for a in expired if lc.lease_expired(a, ts)
    ]
    if out:
        await _notify_ends(cur)
    return out


async def cancel(cur: Cur, rollout_id: str, ts: float) -> Rollout:
    rollout = lc.cancel(await _rollout(cur, rollout_id, lock=True), ts)
    await _update_rollout(cur, rollout)
    await _notify_ends(cur)
    return rollout


# -- calls and rewards ---------------------------------------------------------------------------------------------
async def _owners(cur: Cur, pairs: set[tuple[str, str]], what: str, lock: str = "") -> dict[str, str]:
    """Every (attempt_id, rollout_id) must name an existing attempt of that rollout; returns attempt -> status.
    ``lock`` (``FOR SHARE``) locks the attempts' rows (in id order) until the transaction ends."""
    attempt_ids = sorted({a for a, _ in pairs})
    await cur.execute(
        f"SELECT attempt_id, rollout_id, status FROM attempts WHERE attempt_id = ANY(%s) ORDER BY attempt_id {lock}",
        (attempt_ids,),
    )
    found = {row[0]: (row[1], row[2]) for row in await cur.fetchall()}
    for attempt_id, rollout_id in sorted(pairs):
        owner = found.get(attempt_id)
        lc.check_owner(what, attempt_id, rollout_id, None if owner is None else owner[0])
    return {a: status for a, (_, status) in found.items()}


_INSERT_CALL = (
    "INSERT INTO calls (call_id, attempt_id, rollout_id, seq, started_at, prompt_ids, completion_ids, logprobs, body) "
    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (call_id) DO NOTHING"
)
_REPLACE_CALL = _INSERT_CALL.replace(
    "DO NOTHING",
    "DO UPDATE SET started_at = EXCLUDED.started_at, prompt_ids = EXCLUDED.prompt_ids, "
    "completion_ids = EXCLUDED.completion_ids, logprobs = EXCLUDED.logprobs, body = EXCLUDED.body",
)
"""A re-sent call (``Call.idempotency_key``) replaces the stored call of its id, keeping the stored ``seq`` (in the
statement: a re-sent call racing the first on another proxy waits for its row and keeps its number)."""


async def record_calls(cur: Cur, calls: list[Call], running_only: bool = False) -> None:
    """Insert the calls (a call id already stored is left as it is, unless the call was re-sent:
    ``lc.split_resent``). With ``running_only`` every attempt must still
    be running (``AttemptNotRunningError`` otherwise, and nothing of the batch is recorded); the attempts' rows are
    share-locked so a concurrent finish waits for this batch (module docstring)."""
    statuses = await _owners(
        cur, {(c.attempt_id, c.rollout_id) for c in calls}, "record_calls", "FOR SHARE" if running_only else ""
    )
    if running_only:
        for attempt_id, status in sorted(statuses.items()):
            if status != AttemptStatus.RUNNING.value:
                raise AttemptNotRunningError(f"attempt {attempt_id} is {status!r}: no call is recorded after it ended")
    plain, resent = lc.split_resent(calls)
    if plain:
        await cur.executemany(_INSERT_CALL, [call_to_row(c) for c in plain])
    if resent:
        await cur.executemany(_REPLACE_CALL, [call_to_row(c) for c in resent])


async def reserve_seq(cur: Cur, attempt_id: str, n: int) -> int:
    """The first of ``n`` call numbers reserved for ``attempt_id`` (unique across every process on the store)."""
    await cur.execute(
        "UPDATE attempts SET next_seq = next_seq + %s WHERE attempt_id = %s RETURNING next_seq", (n, attempt_id)
    )
    row = await cur.fetchone()
    if row is None:
        raise NotFoundError(f"no attempt {attempt_id!r}")
    return int(row[0]) - n


async def record_rewards(cur: Cur, rewards: list[Reward]) -> None:
    await _owners(cur, {(r.attempt_id, r.rollout_id) for r in rewards}, "record_rewards")
    await cur.executemany(
        "INSERT INTO rewards (attempt_id, name, call_id, rollout_id, value, created_at) "
        "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (attempt_id, name, call_id) DO UPDATE SET "
        "rollout_id = EXCLUDED.rollout_id, value = EXCLUDED.value, created_at = EXCLUDED.created_at",
        [(r.attempt_id, r.name, r.call_id or "", r.rollout_id, r.value, r.created_at) for r in rewards],
    )


# -- reading -------------------------------------------------------------------------------------------------------
async def _details(cur: Cur, rollouts: list[Rollout]) -> list[RolloutDetail]:
    """The attempts, calls and rewards of ``rollouts`` (three bulk queries, not one per object)."""
    attempts: dict[str, list[Attempt]] = {}
    await cur.execute(
        f"SELECT {ATTEMPT_COLS} FROM attempts WHERE rollout_id = ANY(%s)", ([r.rollout_id for r in rollouts],)
    )
    for row in await cur.fetchall():
        a = attempt_from_row(row)
        attempts.setdefault(a.rollout_id, []).append(a)
    attempt_ids = [a.attempt_id for lst in attempts.values() for a in lst]
    calls: dict[str, list[Call]] = {}
    rewards: dict[str, list[Reward]] = {}
    if attempt_ids:
        await cur.execute(
            "SELECT attempt_id, prompt_ids, completion_ids, logprobs, body, seq FROM calls "
            "WHERE attempt_id = ANY(%s) ORDER BY attempt_id, seq, started_at",
            (attempt_ids,),
        )
        for row in await cur.fetchall():
            calls.setdefault(row[0], []).append(call_from_row(row[1:]))
        await cur.execute(
            "SELECT attempt_id, rollout_id, name, call_id, value, created_at FROM rewards "
            "WHERE attempt_id = ANY(%s) ORDER BY created_at",
            (attempt_ids,),
        )
        for row in await cur.fetchall():
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


async def get_rollout(cur: Cur, rollout_id: str) -> RolloutDetail:
    (detail,) = await _details(cur, [await _rollout(cur, rollout_id)])
    return detail


async def list_rollouts(
    cur: Cur, status: RolloutStatus | None, limit: int, after: str | None
) -> tuple[list[Rollout], str | None]:
    lc.check_limit(limit, "list_rollouts")
    where = "r.seq > %s"
    args: list[Any] = [lc.decode_cursor(after)]
    if status is not None:
        where += " AND r.status = %s"
        args.append(RolloutStatus(status).value)
    await cur.execute(
        f"SELECT r.seq, {ROLLOUT_COLS} FROM rollouts r JOIN groups g ON g.group_id = r.group_id WHERE {where} "
        "ORDER BY r.seq LIMIT %s",
        (*args, limit + 1),
    )
    rows = await cur.fetchall()
    page = [rollout_from_row(row[1:]) for row in rows[:limit]]
    return page, (lc.encode_cursor(rows[limit - 1][0]) if len(rows) > limit else None)


async def list_rollout_details(cur: Cur, limit: int, after: str | None) -> tuple[list[RolloutDetail], str | None]:
    page, nxt = await list_rollouts(cur, None, limit, after)
    return await _details(cur, page), nxt


_READY = (
    "FROM groups g WHERE g.split = %s AND g.consumed_step IS NULL "
    "AND EXISTS (SELECT 1 FROM rollouts r WHERE r.group_id = g.group_id) "
    f"AND NOT EXISTS (SELECT 1 FROM rollouts r WHERE r.group_id = g.group_id AND r.status IN {_UNFINISHED})"
)


async def counts(cur: Cur) -> dict[str, int]:
    """Rollouts by status, counted from the ``rollouts_status`` index (no counter row that every move of every
    process would lock), and the finished unconsumed train groups."""
    out = dict.fromkeys(lc.ROLLOUT_STATUSES, 0)
    await cur.execute("SELECT status, COUNT(*) FROM rollouts GROUP BY status")
    for status, count in await cur.fetchall():
        out[status] = int(count)
    await cur.execute(f"SELECT COUNT(*) {_READY}", ("train",))
    row = await cur.fetchone()
    out["groups_ready"] = int(row[0]) if row else 0
    return out


async def finished_groups(
    cur: Cur, limit: int, split: str, cache: lc.FinishedCache | None = None
) -> list[FinishedGroup]:
    await cur.execute(f"SELECT {GROUP_COLS} {_READY} ORDER BY g.seq LIMIT %s", (split, limit))
    groups = [group_from_row(r) for r in await cur.fetchall()]
    if cache is None:
        return await _with_rollouts(cur, groups)
    known, missing = cache.lookup(groups)
    return cache.answer(split, groups, known, await _with_rollouts(cur, missing))


async def list_group_details(
    cur: Cur, split: str | None, limit: int, after: str | None
) -> tuple[list[FinishedGroup], str | None]:
    lc.check_limit(limit, "list_group_details")
    where = "g.seq > %s"
    args: list[Any] = [lc.decode_cursor(after)]
    if split is not None:
        where += " AND g.split = %s"
        args.append(split)
    await cur.execute(
        f"SELECT g.seq, {GROUP_COLS} FROM groups g WHERE {where} ORDER BY g.seq LIMIT %s", (*args, limit + 1)
    )
    rows = await cur.fetchall()
    page = await _with_rollouts(cur, [group_from_row(row[1:]) for row in rows[:limit]])
    return page, (lc.encode_cursor(rows[limit - 1][0]) if len(rows) > limit else None)


async def _with_rollouts(cur: Cur, groups: list[Group]) -> list[FinishedGroup]:
    """Each group with the details of its rollouts in creation order (a few bulk queries)."""
    if not groups:
        return []
    by_group: dict[str, list[Rollout]] = {}
    await cur.execute(
        f"SELECT {ROLLOUT_COLS} FROM rollouts r JOIN groups g ON g.group_id = r.group_id "
        "WHERE r.group_id = ANY(%s) ORDER BY r.seq",
        ([g.group_id for g in groups],),
    )
    for row in await cur.fetchall():
        rollout = rollout_from_row(row)
        by_group.setdefault(rollout.group_id, []).append(rollout)
    details = {d.rollout.rollout_id: d for d in await _details(cur, [r for lst in by_group.values() for r in lst])}
    return [FinishedGroup(g, [details[r.rollout_id] for r in by_group.get(g.group_id, [])]) for g in groups]


async def consume_groups(cur: Cur, step: int, group_ids: list[str]) -> list[str]:
    fresh: list[str] = []
    for gid in sorted(set(group_ids)):  # lock in id order: two consumers never wait on each other in a cycle
        await _group(cur, gid, lock=True)
    for gid in group_ids:
        await cur.execute("SELECT status FROM rollouts WHERE group_id = %s", (gid,))
        statuses = [RolloutStatus(s) for (s,) in await cur.fetchall()]
        if lc.check_consumable(gid, await _group(cur, gid), statuses, step) and gid not in fresh:
            fresh.append(gid)
    if fresh:
        await cur.execute("UPDATE groups SET consumed_step = %s WHERE group_id = ANY(%s)", (step, fresh))
    return fresh


async def publish_version(cur: Cur, v: PolicyVersion) -> None:
    await cur.execute(
        "INSERT INTO versions (version, step, created_at, meta) VALUES (%s, %s, %s, %s) ON CONFLICT (version) "
        "DO UPDATE SET step = EXCLUDED.step, created_at = EXCLUDED.created_at, meta = EXCLUDED.meta",
        (v.version, v.step, v.created_at, dumps(v.meta, "version meta")),
    )


async def current_version(cur: Cur) -> PolicyVersion | None:
    await cur.execute("SELECT version, step, created_at, meta FROM versions ORDER BY version DESC LIMIT 1")
    row = await cur.fetchone()
    if row is None:
        return None
    return PolicyVersion(version=row[0], step=row[1], created_at=row[2], meta=loads(row[3]))


async def set_resource(cur: Cur, resource: Resource) -> None:
    await cur.execute(
        "INSERT INTO resources (name, body) VALUES (%s, %s) ON CONFLICT (name) DO UPDATE SET body = EXCLUDED.body",
        (resource.name, dumps(resource.model_dump(mode="json"), "resource")),
    )


async def get_resources(cur: Cur) -> list[Resource]:
    await cur.execute("SELECT body FROM resources ORDER BY name")
    return [Resource.model_validate(loads(b)) for (b,) in await cur.fetchall()]


async def set_meta(cur: Cur, key: str, value: Any) -> None:
    await cur.execute(
        "INSERT INTO meta (key, value) VALUES (%s, %s) ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value",
        (key, dumps(value, f"meta {key!r}")),
    )


async def get_meta(cur: Cur, key: str) -> Any | None:
    await cur.execute("SELECT value FROM meta WHERE key = %s", (key,))
    row = await cur.fetchone()
    return None if row is None else loads(row[0])
