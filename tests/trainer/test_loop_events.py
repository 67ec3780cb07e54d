"""The training loop waits for finished groups on the store's signal of ended attempts instead of polling.

A real ``MemoryStore`` / ``SQLiteStore`` counts its reads of the finished groups (a subclass that counts, nothing
else changed). The loop's engine and learner are not used by the wait (stand-ins, said here). Nothing depends on the
machine's speed: the test waits on observable states (reads and idle wake-ups counted, a waiter parked).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from lightning_sdk.app.loop import TrainingLoop
from lightning_sdk.store import HTTPStore, MemoryStore, SQLiteStore, store_routes
from lightning_sdk.store._events import AttemptEnds
from lightning_sdk.types import AttemptStatus, FinishedGroup
from tests.support.proxy import ADMIN_KEY
from tests.support.servers import serve_async
from tests.support.waiting import until_async


def _counting(base: type) -> Any:
    class Counting(base):  # type: ignore[misc, valid-type]
        reads = 0
        expiries = 0

        async def finished_groups(self, **kw: Any) -> list[FinishedGroup]:
            out: list[FinishedGroup] = await super().finished_groups(**kw)
            self.reads += 1  # counted once done: the test knows what the read saw
            return out

        async def expire_leases(self) -> list[Any]:
            self.expiries += 1
            out: list[Any] = await super().expire_leases()
            return out

    return Counting


def _loop(store: Any, tmp_path: Path) -> TrainingLoop:
    stand_in = SimpleNamespace(policy_version=0, weights=dict)  # the wait uses neither engine nor learner
    loop = TrainingLoop(
        store,
        stand_in,  # type: ignore[arg-type]
        stand_in,  # type: ignore[arg-type]
        tmp_path / "run",
        train_tasks=[{"q": 1}, {"q": 2}],
        tasks_per_step=2,
        samples_per_task=1,
        max_staleness=0,
    )
    loop.IDLE_S = 0.001  # idle wake-ups as often as possible: they must not read the groups
    return loop


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_the_wait_for_groups_reads_them_only_after_attempts_end(kind: str, tmp_path: Path) -> None:
    store = _counting(MemoryStore)() if kind == "memory" else _counting(SQLiteStore)(tmp_path / "s.db")
    try:
        loop = _loop(store, tmp_path)
        take = asyncio.create_task(loop._take_groups(lambda: False))
        await until_async(lambda: store.expiries >= 1, what="the first look at the groups")
        assert store.reads == 1  # nothing finished yet
        idle = store.expiries
        await until_async(lambda: store.expiries >= idle + 5, what="five idle wake-ups")
        assert store.reads == 1 and not take.done()  # waking to check stop() and leases reads nothing
        first = await store.claim("w", split="train")
        assert first is not None
        await store.finish_attempt(first.attempt.attempt_id, AttemptStatus.SUCCEEDED)
        await until_async(lambda: store.reads == 2, what="a read after the attempt ended")
        assert not take.done()  # one group of two
        second = await store.claim("w", split="train")
        assert second is not None
        await store.finish_attempt(second.attempt.attempt_id, AttemptStatus.SUCCEEDED)
        taken, _ = await asyncio.wait_for(take, 30)
        assert sorted(g.group.group_id for g in taken.fresh) == ["train-0", "train-1"] and taken.stale == []
        assert store.reads == 3
    finally:
        await store.close()


async def test_a_remote_store_is_read_at_bounded_intervals(tmp_path: Path) -> None:
    """``HTTPStore`` has no signal (attempts end in another process): the loop reads the groups at bounded intervals
    and still returns them. A real store server on loopback (``store_routes`` over a ``MemoryStore``)."""
    backing = MemoryStore()
    app = Starlette(routes=[Mount("/lightning/v1/store", routes=store_routes(backing, ADMIN_KEY))])
    async with serve_async(app) as srv:
        store = _counting(HTTPStore)(f"{srv.url}/lightning/v1/store", ADMIN_KEY)
        try:
            assert getattr(store, "attempt_ends", None) is None
            loop = _loop(store, tmp_path)
            take = asyncio.create_task(loop._take_groups(lambda: False))
            await until_async(lambda: store.reads >= 3, what="three reads without a signal")
            for _ in range(2):
                claim = await store.claim("w", split="train")
                assert claim is not None
                await store.finish_attempt(claim.attempt.attempt_id, AttemptStatus.SUCCEEDED)
            taken, _ = await asyncio.wait_for(take, 30)
            assert len(taken.fresh) == 2
        finally:
            await store.close()


async def test_the_signal_wakes_waiters_on_other_loops() -> None:
    """A proxy on a server thread ends attempts; the trainer waits on its own loop."""
    ends = AttemptEnds()
    waiter = asyncio.create_task(ends.wait(0, timeout=30))
    await until_async(lambda: ends.waiting == 1, what="the waiter parked")
    await asyncio.to_thread(ends.bump)  # from another thread
    assert await asyncio.wait_for(waiter, 30) == 1
    assert await ends.wait(0, timeout=30) == 1  # a count already past ``seen`` returns at once
    assert ends.waiting == 0
