"""PostgresStore specifics, on the session's real PostgreSQL server (tests/conftest.py): the schema's version and
migration on open, several store objects (as several processes would) on one database, the store-side finish
barrier and call numbering, NOTIFY of ended attempts, and errors. The Store protocol itself is tested over every
store in test_store_behaviour.py."""

from __future__ import annotations

import asyncio
import threading

import psycopg
import pytest

from lightning_sdk.errors import AttemptNotRunningError, ConfigError, StoreError, StoreUnavailableError
from lightning_sdk.store import _postgres_ops as ops
from lightning_sdk.store import open_store
from lightning_sdk.store.postgres import PostgresStore
from lightning_sdk.types import AttemptStatus, Call

from ..support.waiting import until_async


def _call(attempt_id: str, rollout_id: str, i: int, seq: int | None = None) -> Call:
    return Call(
        call_id=f"c-{attempt_id}-{i}",
        attempt_id=attempt_id,
        rollout_id=rollout_id,
        seq=i if seq is None else seq,
        model="policy",
        prompt_ids=[1, 2, i],
        completion_ids=[3, i],
        logprobs=[-0.25, -1e-300],
        started_at=float(i),
    )


def _version(url: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT version FROM schema_version").fetchone()
        assert row is not None
        return int(row[0])


async def test_schema_is_versioned_and_created_once_by_concurrent_openers(postgres_url: str) -> None:
    errors: list[BaseException] = []

    def open_one() -> None:
        try:
            asyncio.run(PostgresStore(postgres_url, listen=False).close())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert _version(postgres_url) == ops.SCHEMA_VERSION
    with psycopg.connect(postgres_url) as conn:
        assert conn.execute("SELECT COUNT(*) FROM schema_version").fetchone() == (1,)


async def test_a_newer_schema_is_refused_and_left_untouched(postgres_url: str) -> None:
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        conn.execute("INSERT INTO schema_version VALUES (99)")
    with pytest.raises(StoreError, match="schema version 99"):
        PostgresStore(postgres_url)
    with psycopg.connect(postgres_url) as conn:
        tables = {r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert tables == {"schema_version"}


async def test_an_older_schema_is_migrated_on_open(postgres_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The migration path for real: a database of the current version, opened by a build whose schema is one
    version newer (a column added to ``meta``), is migrated in place and keeps its data."""
    store = PostgresStore(postgres_url)
    await store.set_meta("ckpt", {"step": 3})
    await store.close()
    monkeypatch.setattr(ops, "SCHEMA_VERSION", ops.SCHEMA_VERSION + 1)
    monkeypatch.setitem(ops.MIGRATIONS, ops.SCHEMA_VERSION - 1, "ALTER TABLE meta ADD COLUMN note TEXT")
    again = PostgresStore(postgres_url)
    try:
        assert await again.get_meta("ckpt") == {"step": 3}
        assert _version(postgres_url) == ops.SCHEMA_VERSION
        with psycopg.connect(postgres_url) as conn:
            cols = {
                r[0]
                for r in conn.execute("SELECT column_name FROM information_schema.columns WHERE table_name = 'meta'")
            }
        assert cols == {"key", "value", "note"}
    finally:
        await again.close()


async def test_two_store_objects_never_share_a_claim(postgres_url: str) -> None:
    """Two stores on one database (as two processes): 40 concurrent claims for 24 rollouts give 24 distinct ones."""
    a, b = PostgresStore(postgres_url), PostgresStore(postgres_url)
    try:
        await a.enqueue([{"q": i} for i in range(6)], n=4)
        claims = await asyncio.gather(*[(a if i % 2 else b).claim(f"w{i}", lease_s=60) for i in range(40)])
        got = [c.rollout.rollout_id for c in claims if c is not None]
        assert len(got) == 24 and len(set(got)) == 24
        assert (await b.counts())["running"] == 24
    finally:
        await a.close()
        await b.close()


async def test_an_attempt_ended_by_another_store_wakes_this_ones_waiters(postgres_url: str) -> None:
    a, b = PostgresStore(postgres_url), PostgresStore(postgres_url)
    try:
        claim = await a.open_session({"q": 1})
        await a.get_meta("x")  # opens a's pool and its NOTIFY listener
        await until_async(lambda: a.attempt_ends.count >= 1, timeout=30, what="a's listener to start")
        seen = a.attempt_ends.count
        waiter = asyncio.ensure_future(a.attempt_ends.wait(seen, timeout=30))
        await b.finish_attempt(claim.attempt.attempt_id, AttemptStatus.SUCCEEDED)
        assert await waiter > seen
    finally:
        await a.close()
        await b.close()


async def test_a_token_read_again_after_its_ttl_sees_another_stores_finish(postgres_url: str) -> None:
    a, b = PostgresStore(postgres_url, token_ttl_s=0.0), PostgresStore(postgres_url)
    try:
        claim = await a.open_session({"q": 1})
        assert (await a.attempt_by_token(claim.attempt.token)).status is AttemptStatus.RUNNING  # type: ignore[union-attr]
        await b.finish_attempt(claim.attempt.attempt_id, AttemptStatus.FAILED, "ended elsewhere")
        found = await a.attempt_by_token(claim.attempt.token)
        assert found is not None and found.status is AttemptStatus.FAILED and found.error == "ended elsewhere"
        assert await a.attempt_by_token("lsk-unknown") is None
    finally:
        await a.close()
        await b.close()


async def test_running_only_refuses_a_whole_batch_once_the_attempt_ended(postgres_url: str) -> None:
    store = PostgresStore(postgres_url)
    try:
        one, two = await store.open_session({"q": 1}), await store.open_session({"q": 2})
        a1, r1 = one.attempt.attempt_id, one.rollout.rollout_id
        a2, r2 = two.attempt.attempt_id, two.rollout.rollout_id
        await store.record_calls([_call(a1, r1, 0)], running_only=True)
        await store.finish_attempt(a1, AttemptStatus.SUCCEEDED)
        with pytest.raises(AttemptNotRunningError, match=f"attempt {a1} is 'succeeded'"):
            await store.record_calls([_call(a2, r2, 0), _call(a1, r1, 1)], running_only=True)
        assert [c.call_id for c in (await store.get_rollout(r1)).attempts[0].calls] == [f"c-{a1}-0"]
        assert (await store.get_rollout(r2)).attempts[0].calls == []  # nothing of the refused batch landed
        await store.record_calls([_call(a1, r1, 2)])  # without running_only: the plain protocol (an import)
        assert len((await store.get_rollout(r1)).attempts[0].calls) == 2
    finally:
        await store.close()


async def test_finish_waits_for_a_batch_in_flight_and_counts_it(postgres_url: str) -> None:
    """The barrier is a row lock: a batch that holds the attempt's share lock commits before the finish that waits
    for it, and a batch that comes after the finish is refused."""
    a, b = PostgresStore(postgres_url), PostgresStore(postgres_url)
    try:
        claim = await a.open_session({"q": 1})
        aid, rid = claim.attempt.attempt_id, claim.rollout.rollout_id
        held = await psycopg.AsyncConnection.connect(postgres_url)
        await held.execute("SELECT 1 FROM attempts WHERE attempt_id = %s FOR SHARE", (aid,))  # a batch in flight
        finishing = asyncio.ensure_future(b.finish_attempt(aid, AttemptStatus.SUCCEEDED))
        async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as watch:

            async def waiting_on_the_lock() -> bool:  # the finish is seen waiting on the lock (pg_stat_activity)
                cur = await watch.execute("SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'")
                return (await cur.fetchone()) == (1,)

            await until_async(waiting_on_the_lock, timeout=30, what="the finish to wait on the lock", every=0.01)
        assert not finishing.done()
        await held.execute(ops._INSERT_CALL, ops.call_to_row(_call(aid, rid, 0)))
        await held.commit()
        await held.close()
        assert (await finishing).status is AttemptStatus.SUCCEEDED
        with pytest.raises(AttemptNotRunningError):
            await a.record_calls([_call(aid, rid, 1)], running_only=True)
        assert [c.seq for c in (await a.get_rollout(rid)).attempts[0].calls] == [0]
    finally:
        await a.close()
        await b.close()


async def test_reserve_seq_is_unique_across_store_objects(postgres_url: str) -> None:
    a, b = PostgresStore(postgres_url), PostgresStore(postgres_url)
    try:
        claim = await a.open_session({"q": 1})
        aid = claim.attempt.attempt_id
        firsts = await asyncio.gather(*[(a if i % 2 else b).reserve_seq(aid, 1 + i % 3) for i in range(60)])
        numbers = sorted(f + k for i, f in enumerate(firsts) for k in range(1 + i % 3))
        assert numbers == list(range(sum(1 + i % 3 for i in range(60))))
        with pytest.raises(ConfigError):
            await a.reserve_seq(aid, 0)
    finally:
        await a.close()
        await b.close()


async def test_one_store_serves_two_event_loops(postgres_url: str) -> None:
    """A pool is bound to its loop: a second loop (a server thread's) gets its own pool on the same store."""
    store = PostgresStore(postgres_url)
    try:
        claim = await store.open_session({"q": 1})
        seen: list[object] = []
        thread = threading.Thread(
            target=lambda: seen.append(asyncio.run(store.get_attempt(claim.attempt.attempt_id))), daemon=True
        )
        thread.start()
        thread.join(30)
        assert seen == [claim.attempt]
        assert (await store.get_attempt(claim.attempt.attempt_id)) == claim.attempt
    finally:
        await store.close()


async def test_open_store_and_errors(postgres_url: str) -> None:
    store = open_store(postgres_url)
    try:
        assert isinstance(store, PostgresStore)
    finally:
        await store.close()
    with pytest.raises(ConfigError, match="postgresql://"):
        PostgresStore("mysql://x@localhost/db")
    with pytest.raises(StoreUnavailableError) as info:
        PostgresStore("postgresql://someone:s3cret@127.0.0.1:1/nothing", connect_timeout_s=2)
    assert "s3cret" not in str(info.value) and ":***@" in str(info.value)
    closed = PostgresStore(postgres_url)
    await closed.close()
    with pytest.raises(StoreUnavailableError, match="closed"):
        await closed.counts()
