"""The recorder: batches, back-pressure on a bounded queue, the per-attempt flush barrier, and bad items isolated.

The store is the real ``SQLiteStore`` (a file in tmp_path); ``GatedStore`` wraps it only to hold writes back until
the test opens the gate, which is how a slow disk looks from the recorder's side.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from lightning_sdk.errors import StoreError
from lightning_sdk.proxy import Recorder
from lightning_sdk.store import SQLiteStore
from lightning_sdk.types import Call, Reward
from tests.support.waiting import until_async


class GatedStore:
    """A real store whose ``record_calls`` waits for ``gate`` (and counts its batches)."""

    def __init__(self, inner: SQLiteStore) -> None:
        self.inner = inner
        self.gate = asyncio.Event()
        self.batches: list[int] = []

    async def record_calls(self, calls: list[Call]) -> None:
        await self.gate.wait()
        self.batches.append(len(calls))
        await self.inner.record_calls(calls)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _call(claim: Any, i: int) -> Call:
    return Call(
        call_id=f"call-{claim.attempt.attempt_id}-{i}",
        attempt_id=claim.attempt.attempt_id,
        rollout_id=claim.rollout.rollout_id,
        seq=i,
        model="policy",
        prompt_ids=[1, 2, i],
        completion_ids=[3, i],
        logprobs=[-0.5, -0.25],
    )


async def test_back_pressure_batches_and_flush(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    gated = GatedStore(store)
    claim = await store.open_session({"t": 1})
    recorder = Recorder(gated, max_pending=3, max_batch=100, linger_s=0.0)  # type: ignore[arg-type]
    recorder.start()

    for i in range(4):  # one is taken by the writer (blocked on the gate), three fill the queue
        await asyncio.wait_for(recorder.add_call(_call(claim, i)), 1.0)
    blocked = asyncio.ensure_future(recorder.add_call(_call(claim, 4)))
    await until_async(lambda: recorder.pending == 5, timeout=5, what="the fifth call counted")
    assert not blocked.done()  # back-pressure: the producer waits (its first step ran) instead of queueing
    assert gated.batches == []  # nothing can make room while the writer is held at the gate

    flushed = asyncio.ensure_future(recorder.flush(claim.attempt.attempt_id))
    await until_async(lambda: len(recorder._waiters) == 1, timeout=5, what="the flush waiting")
    assert not flushed.done()
    gated.gate.set()
    await asyncio.wait_for(blocked, 2.0)
    await asyncio.wait_for(flushed, 2.0)
    detail = await store.get_rollout(claim.rollout.rollout_id)
    assert [c.seq for c in detail.attempts[0].calls][:4] == [0, 1, 2, 3]
    await recorder.drain()
    assert recorder.pending == 0
    assert sum(gated.batches) == 5 and len(gated.batches) < 5  # batched
    await recorder.stop()
    await store.close()


async def test_a_bad_item_is_isolated_and_reported_by_flush(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    good = await store.open_session()
    recorder = Recorder(store, linger_s=0.05)
    recorder.start()
    bad = Call(call_id="call-x", attempt_id="at-missing", rollout_id="ro-missing", model="policy")
    await recorder.add_call(_call(good, 0))
    await recorder.add_call(bad)
    await recorder.add_reward(Reward(rollout_id=good.rollout.rollout_id, attempt_id=good.attempt.attempt_id, value=1.0))
    await recorder.flush(good.attempt.attempt_id)  # the good attempt is whole
    with pytest.raises(StoreError, match="could not be recorded"):
        await recorder.flush("at-missing")
    detail = await store.get_rollout(good.rollout.rollout_id)
    assert len(detail.attempts[0].calls) == 1 and detail.attempts[0].rewards[0].value == 1.0
    await recorder.stop()
    await store.close()
