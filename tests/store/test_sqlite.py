"""SQLiteStore specifics: durability across SIGKILL, reopening, the token cache, indexes and error translation."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_sdk.errors import StoreError, StoreUnavailableError
from lightning_sdk.store import ManualClock, SQLiteStore
from lightning_sdk.store import _sqlite_ops as ops
from lightning_sdk.types import AttemptStatus, RolloutStatus

from .crash_writer import ids_for

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def _run_writer_and_kill(db: Path, kill_after_finishes: int) -> tuple[list[str], list[str]]:
    """Start crash_writer.py, SIGKILL it after ``kill_after_finishes`` reported finishes (mid-loop), and return
    the call ids and attempt ids it reported committed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "crash_writer.py"), str(db)], stdout=subprocess.PIPE, env=env, text=True
    )
    assert proc.stdout is not None
    calls: list[str] = []
    finished: list[str] = []
    killed = False
    try:
        # Read every line the writer printed, also those still in the pipe after the kill: on a loaded machine the
        # writer runs ahead of this reader, and each printed line is a write it reported committed.
        for line in proc.stdout:
            kind, *ids = line.split()
            if kind == "CALL":
                calls.extend(ids)
            elif kind == "FINISH":
                finished.extend(ids)
                if len(finished) >= kill_after_finishes and not killed:
                    os.kill(proc.pid, signal.SIGKILL)  # the writer is already busy with its next attempt
                    killed = True
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    return calls, finished


@pytest.mark.parametrize("kill_after", [5, 40])
async def test_committed_data_survives_sigkill(tmp_path: Path, kill_after: int) -> None:
    db = tmp_path / "crash.db"
    calls, finished = _run_writer_and_kill(db, kill_after)
    assert len(finished) >= kill_after and len(calls) >= 3 * len(finished)

    raw = sqlite3.connect(db)
    assert raw.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert raw.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    raw.close()

    clock = ManualClock(time.time())
    store = SQLiteStore(db, clock=clock)
    try:
        for aid in finished:
            assert (await store.get_attempt(aid)).status is AttemptStatus.SUCCEEDED
        seen: dict[str, list[int]] = {}
        rollouts, cursor = await store.list_rollouts(limit=1000)
        while cursor is not None:
            more, cursor = await store.list_rollouts(limit=1000, after=cursor)
            rollouts.extend(more)
        counts = await store.counts()
        # the writer may have committed one finish it had not yet printed when the kill landed
        assert len(finished) <= counts["succeeded"] <= len(finished) + 1 and counts["running"] <= 1
        touched = [r for r in rollouts if r.status is not RolloutStatus.QUEUED]
        for r in touched:
            detail = await store.get_rollout(r.rollout_id)
            statuses = [a.attempt.status for a in detail.attempts]
            assert r.attempts_used == sum(s is not AttemptStatus.RELEASED for s in statuses)
            if r.status is RolloutStatus.SUCCEEDED:
                assert statuses == [AttemptStatus.SUCCEEDED]
                (att,) = detail.attempts
                assert len(att.calls) == 3 and len(att.rewards) == 1
            else:  # the attempt cut off by the kill: still running, never succeeded
                assert r.status is RolloutStatus.RUNNING and statuses == [AttemptStatus.RUNNING]
            for a in detail.attempts:
                for c in a.calls:
                    seen[c.call_id] = c.completion_ids
                    assert (c.prompt_ids, c.completion_ids, c.logprobs) == ids_for(c.call_id)
        assert set(calls) <= set(seen)

        # the cut-off attempt's lease (0.5 s, from the writer's wall clock) expires and its rollout is retried,
        # never read as succeeded
        clock.advance(60)
        expired = await store.expire_leases()
        assert len(expired) == counts["running"]
        for a in expired:
            assert (await store.get_rollout(a.rollout_id)).rollout.status is RolloutStatus.QUEUED
    finally:
        await store.close()


async def test_reopen_reloads_the_running_attempts_into_the_token_cache(tmp_path: Path) -> None:
    """The SQLite specifics of a reopen (the rest runs over every durable store in test_store_behaviour.py): the
    running attempts are reloaded into the token cache, and an ended attempt leaves it."""
    db = tmp_path / "s.db"
    store = SQLiteStore(db)
    await store.enqueue([{"q": 1}, {"q": 2}], n=1, group_ids=["g1", "g2"])
    claim = await store.claim("w", lease_s=60)
    assert claim is not None
    await store.close()
    again = SQLiteStore(db)
    try:
        assert again._running.keys() == {claim.attempt.token}
        await again.finish_attempt(claim.attempt.attempt_id, AttemptStatus.FAILED, "x")
        assert again._running == {}
    finally:
        await again.close()


async def test_schema_uses_indexes(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    store = SQLiteStore(db)
    await store.close()
    conn = sqlite3.connect(db)
    try:

        def plan(sql: str, *args: object) -> str:
            return " ".join(str(r[-1]) for r in conn.execute("EXPLAIN QUERY PLAN " + sql, args))

        assert "INDEX" in plan("SELECT * FROM attempts WHERE token = ?", "t")
        assert "INDEX" in plan("SELECT * FROM calls WHERE attempt_id = ? ORDER BY seq", "a")
        assert "rollouts_queue" in plan(
            "SELECT * FROM rollouts r WHERE r.status = 'queued' AND r.split = ? ORDER BY r.seq LIMIT 1", "train"
        )
        assert "attempts_running" in plan(
            "SELECT * FROM attempts WHERE status = 'running' AND lease_expires_at <= ?",
            1.0,
        )
        ready = "SELECT g.seq " + ops._READY + " ORDER BY g.seq LIMIT 10"  # finished_groups and counts()
        assert "groups_unconsumed" in plan(ready, "train")
        assert "rollouts_group" in plan(ready, "train")  # the EXISTS checks of each unconsumed group
        assert conn.execute("PRAGMA user_version").fetchone() == (2,)
    finally:
        conn.close()


async def test_counts_are_kept_by_triggers_and_match_a_full_count(tmp_path: Path) -> None:
    """``counts()`` reads ``rollout_counts`` (kept by triggers), never the rollouts table: after every kind of move
    it equals a count over the table."""
    clock = ManualClock(100.0)
    db = tmp_path / "s.db"
    store = SQLiteStore(db, clock=clock)
    raw = sqlite3.connect(db)

    def full_count() -> dict[str, int]:
        out = dict.fromkeys(("queued", "running", "succeeded", "failed", "cancelled"), 0)
        out.update(raw.execute("SELECT status, COUNT(*) FROM rollouts GROUP BY status").fetchall())
        return out

    async def check() -> None:
        counts = await store.counts()
        assert {k: v for k, v in counts.items() if k != "groups_ready"} == full_count()

    try:
        await store.enqueue([{"q": i} for i in range(4)], n=2, max_attempts=2)
        await check()
        first = await store.claim("w", lease_s=5)
        second = await store.claim("w", lease_s=5)
        assert first is not None and second is not None
        await check()
        await store.finish_attempt(first.attempt.attempt_id, AttemptStatus.SUCCEEDED)
        await store.finish_attempt(second.attempt.attempt_id, AttemptStatus.FAILED, "x")  # queued again
        await check()
        third = await store.claim("w", lease_s=5)
        assert third is not None
        clock.advance(10)
        assert len(await store.expire_leases()) == 1
        await check()
        rollouts, _ = await store.list_rollouts(status=RolloutStatus.QUEUED)
        await store.cancel_rollout(rollouts[-1].rollout_id)
        await store.open_session({"q": "by hand"})
        await check()
        assert (await store.counts())["cancelled"] == 1 and (await store.counts())["running"] == 1
        # the counts come from the small table: its rows are the counts
        assert dict(raw.execute("SELECT status, n FROM rollout_counts WHERE n > 0").fetchall()) == {
            k: v for k, v in full_count().items() if v
        }
    finally:
        raw.close()
        await store.close()


async def test_a_schema_1_file_is_migrated_on_open(tmp_path: Path) -> None:
    """A store file written by the previous schema (no ``rollout_counts``) opens, gets its counts filled once, and
    keeps them from then on; the old code's data is all there."""
    db = tmp_path / "old.db"
    store = SQLiteStore(db)
    await store.enqueue([{"q": i} for i in range(3)], n=2, group_ids=["g0", "g1", "g2"])
    claim = await store.claim("w", lease_s=600)
    assert claim is not None
    await store.finish_attempt(claim.attempt.attempt_id, AttemptStatus.SUCCEEDED)
    await store.claim("w", lease_s=600)
    await store.close()
    raw = sqlite3.connect(db, isolation_level=None)  # make it the file schema 1 wrote
    for trigger in ("rollout_counts_insert", "rollout_counts_update", "rollout_counts_delete"):
        raw.execute(f"DROP TRIGGER {trigger}")
    raw.execute("DROP TABLE rollout_counts")
    raw.execute("PRAGMA user_version = 1")
    raw.close()

    again = SQLiteStore(db)
    try:
        assert await again.counts() == {
            "queued": 4, "running": 1, "succeeded": 1, "failed": 0, "cancelled": 0, "groups_ready": 0
        }  # fmt: skip
        await again.enqueue([{"q": 9}], n=3)
        assert (await again.counts())["queued"] == 7
        assert [g.group.group_id for g in (await again.list_group_details(limit=10))[0]][:3] == ["g0", "g1", "g2"]
    finally:
        await again.close()
    raw = sqlite3.connect(db)
    assert raw.execute("PRAGMA user_version").fetchone() == (2,)
    raw.close()


async def test_a_new_file_has_16k_pages_and_an_older_4k_file_keeps_working(tmp_path: Path) -> None:
    """New store files get 16 KB pages (a recorded call is a 1-10 KB row); a file made with SQLite's default 4 KB
    pages keeps them (SQLite fixes the page size with the first table) and is read and written as before."""
    new = SQLiteStore(tmp_path / "new.db")
    await new.close()
    raw = sqlite3.connect(tmp_path / "new.db")
    assert raw.execute("PRAGMA page_size").fetchone() == (16384,)
    assert raw.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    raw.close()

    old_db = tmp_path / "old.db"
    raw = sqlite3.connect(old_db, isolation_level=None)
    raw.execute("PRAGMA page_size = 4096")
    raw.execute("PRAGMA journal_mode = WAL")  # the file as the store wrote it before: 4 KB pages, WAL
    raw.close()
    old = SQLiteStore(old_db)
    try:
        await old.enqueue([{"q": 1}], n=2, group_ids=["g"])
        claim = await old.claim("w", lease_s=600)
        assert claim is not None
        assert (await old.counts())["running"] == 1
    finally:
        await old.close()
    raw = sqlite3.connect(old_db)
    assert raw.execute("PRAGMA page_size").fetchone() == (4096,)
    assert raw.execute("SELECT count(*) FROM rollouts").fetchone() == (2,)
    raw.close()


async def test_sqlite_errors_are_translated(tmp_path: Path) -> None:
    bad = tmp_path / "not-a-db.db"
    bad.write_bytes(b"this is not a sqlite file" * 100)
    with pytest.raises(StoreUnavailableError):
        SQLiteStore(bad)
    with pytest.raises(StoreError):
        SQLiteStore(tmp_path / "x.db", synchronous="OFF")  # type: ignore[arg-type]


async def test_locked_database_raises_store_unavailable(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    store = SQLiteStore(db, busy_timeout_s=0.1)
    other = sqlite3.connect(db, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        with pytest.raises(StoreUnavailableError, match="locked"):
            await store.enqueue([{"q": 1}])
        other.execute("ROLLBACK")
        (group,) = await store.enqueue([{"q": 1}])  # works again once the lock is gone
        assert group.task == {"q": 1}
    finally:
        other.close()
        await store.close()


async def test_reads_do_not_wait_for_the_writer(tmp_path: Path) -> None:
    """Reads run on their own connection: a long write transaction does not block them (WAL)."""
    store = SQLiteStore(tmp_path / "s.db")
    try:
        await store.enqueue([{"q": i} for i in range(3)])
        release = asyncio.Event()
        started = asyncio.Event()
        loop = asyncio.get_running_loop()

        def slow_write(conn: sqlite3.Connection) -> int:
            conn.execute("UPDATE rollouts SET updated_at = updated_at")
            loop.call_soon_threadsafe(started.set)
            asyncio.run_coroutine_threadsafe(release.wait(), loop).result(timeout=10)
            return 1

        writing = asyncio.create_task(store._write(slow_write))
        await asyncio.wait_for(started.wait(), timeout=10)  # the write transaction is open now
        counts = await asyncio.wait_for(store.counts(), timeout=5)  # answered while the write is open
        assert counts["queued"] == 3 and not writing.done()
        release.set()
        assert await writing == 1
    finally:
        await store.close()


async def test_foreign_schema_version_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "future.db"
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(StoreError, match="schema version 99"):
        SQLiteStore(db)
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT name FROM sqlite_master").fetchall() == []  # the file was left untouched
    conn.close()


def test_call_row_body_is_the_model_dump_of_the_other_fields() -> None:
    """``call_to_row`` reads the fields off the model instead of ``model_dump`` (a deep copy first): the stored JSON
    is still exactly the dump (field order included), models nested in free-form fields are dumped as
    ``model_dump`` would, and a value that is not JSON is a ``ConfigError`` naming the call."""
    import orjson

    from lightning_sdk.errors import ConfigError
    from lightning_sdk.store._sqlite_rows import call_from_row, call_to_row
    from lightning_sdk.types import Call, Reward

    nested = Reward(rollout_id="r", attempt_id="a", value=0.5, created_at=1.0)
    call = Call(
        call_id="c-1",
        attempt_id="a",
        rollout_id="r",
        seq=3,
        model="policy",
        request={"messages": [{"role": "user", "content": "héllo ✓"}], "stop": ("a", "b"), "meta": nested},
        response={"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "logprobs": None}]},
        prompt_ids=[1, 2, 3],
        completion_ids=[4, 5],
        logprobs=[-0.5, -1e-300],
        usage={"prompt_tokens": 3},
        checks={"n_choices": 2},
        ended_at=2.5,
    )
    row = call_to_row(call)
    blobs = {"prompt_ids", "completion_ids", "logprobs"}
    assert row[-1] == orjson.dumps(call.model_dump(mode="json", exclude=blobs)).decode()
    back = call_from_row(row[5:])
    assert back.request["meta"] == nested.model_dump(mode="json") and back.request["stop"] == ["a", "b"]
    assert back.model_dump(exclude={"request"}) == call.model_dump(exclude={"request"})
    with pytest.raises(ConfigError, match="call c-1 is not JSON-serialisable"):
        call_to_row(call.model_copy(update={"checks": {"bad": object()}}))


async def test_finished_groups_load_the_details_of_each_group_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read of the finished groups loads the rollouts, attempts and calls only of groups it has not loaded yet (or
    whose row changed): reading 40 waiting groups ten times while one more finishes loads 41 groups' details, not
    401 (before: every read loaded every waiting group, ~13% of a core in the calc example's RL phase)."""
    loaded: list[str] = []
    real = ops._with_rollouts

    def spy(conn: sqlite3.Connection, groups: list) -> list:  # type: ignore[type-arg]
        loaded.extend(g.group_id for g in groups)
        return real(conn, groups)

    monkeypatch.setattr(ops, "_with_rollouts", spy)
    store = SQLiteStore(tmp_path / "store.db")
    try:
        await store.enqueue([{"i": i} for i in range(41)], n=2, group_ids=[f"g{i:02d}" for i in range(41)])
        for _ in range(80):
            claim = await store.claim("w", split="train")
            assert claim is not None
            await store.finish_attempt(claim.attempt.attempt_id, AttemptStatus.SUCCEEDED)
        reads = [await store.finished_groups(limit=64, split="train") for _ in range(10)]
        assert all(len(r) == 40 for r in reads) and len(loaded) == 40
        assert all(r == reads[0] for r in reads)
        for _ in range(2):
            claim = await store.claim("w", split="train")
            assert claim is not None
            await store.finish_attempt(claim.attempt.attempt_id, AttemptStatus.SUCCEEDED)
        last = await store.finished_groups(limit=64, split="train")
        assert [g.group.group_id for g in last] == [f"g{i:02d}" for i in range(41)] and loaded[40:] == ["g40"]
        await store.consume_groups(1, [f"g{i:02d}" for i in range(30)])
        assert len(await store.finished_groups(limit=64, split="train")) == 11 and len(store._finished) == 11
    finally:
        await store.close()


def test_finished_cache_answers_from_its_snapshot_when_a_concurrent_read_forgot_a_group() -> None:
    """Two reads at once (the PostgreSQL store reads from any event loop): the later one, seeing a group consumed,
    forgets it while the earlier one is loading the rest; the earlier one still answers every group it found ready
    (from the snapshot ``known`` took), and the forgotten group is loaded again by the next read that finds it."""
    from lightning_sdk.store import _lifecycle as lc
    from lightning_sdk.types import FinishedGroup

    a, b, c = (lc.new_group({"i": i}, 2, "train", f"g{i}", 0.0) for i in range(3))
    cache = lc.FinishedCache()
    cache.answer("train", [a, b], {}, [FinishedGroup(a, []), FinishedGroup(b, [])])
    known, missing = cache.lookup([a, b, c])  # the earlier read: a and b known, c to load
    assert set(known) == {"g0", "g1"} and missing == [c]
    assert [fg.group.group_id for fg in cache.answer("train", [b], cache.lookup([b])[0], [])] == ["g1"]  # a consumed
    earlier = cache.answer("train", [a, b, c], known, [FinishedGroup(c, [])])
    assert [fg.group.group_id for fg in earlier] == ["g0", "g1", "g2"]
    assert set(cache.lookup([a, b, c])[0]) == {"g1", "g2"}  # g0 forgotten: the next read that finds it loads it
    joined = a.model_copy(update={"n": 3})  # a session joined g0: its row changed, its details load again
    assert cache.lookup([joined, b])[1] == [joined]
