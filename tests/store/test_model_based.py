"""MemoryStore and SQLiteStore agree: random operation sequences (legal and illegal) give the same outcomes and
the same observable state in both (hypothesis)."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_sdk.errors import LightningSDKError
from lightning_sdk.store import MemoryStore, SQLiteStore, Store
from lightning_sdk.types import AttemptStatus

SPLITS = st.sampled_from(["train", "eval"])
OPS = st.one_of(
    st.tuples(st.just("enqueue"), st.integers(1, 3), st.integers(1, 3), SPLITS),
    st.tuples(st.just("claim"), st.one_of(st.none(), SPLITS)),
    st.tuples(st.just("finish"), st.integers(0, 20), st.sampled_from(list(AttemptStatus))),
    st.tuples(st.just("heartbeat"), st.integers(0, 20)),
    st.tuples(st.just("cancel"), st.integers(0, 20)),
    st.tuples(st.just("consume"), st.integers(1, 3), st.integers(1, 3)),
)


class Driver:
    """Applies the abstract operations to one store, naming objects by creation position (ids are random)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.attempts: list[str] = []
        self.groups = 0

    async def apply(self, op: tuple[Any, ...]) -> Any:
        try:
            return await self._apply(op)
        except LightningSDKError as exc:
            return type(exc).__name__

    async def _apply(self, op: tuple[Any, ...]) -> Any:
        kind = op[0]
        s = self.store
        if kind == "enqueue":
            self.groups += 1
            (g,) = await s.enqueue([{"g": self.groups}], n=op[1], max_attempts=op[2], split=op[3],
                                   group_ids=[f"g{self.groups}"])  # fmt: skip
            return g.group_id
        if kind == "claim":
            claim = await s.claim("w", split=op[1])
            if claim is None:
                return None
            self.attempts.append(claim.attempt.attempt_id)
            return (claim.rollout.group_id, claim.attempt.index, claim.rollout.attempts_used)
        if kind in ("finish", "heartbeat"):
            if not self.attempts:
                return "no attempts"
            aid = self.attempts[op[1] % len(self.attempts)]
            if kind == "heartbeat":
                return (await s.heartbeat(aid)).status.value
            a = await s.finish_attempt(aid, op[2], "err" if op[2] is AttemptStatus.FAILED else None)
            return (a.status.value, a.error)
        if kind == "cancel":
            rollouts, _ = await s.list_rollouts(limit=1000)
            if not rollouts:
                return "no rollouts"
            return (await s.cancel_rollout(rollouts[op[1] % len(rollouts)].rollout_id)).status.value
        ready = await s.finished_groups()
        return await s.consume_groups(op[1], [f.group.group_id for f in ready[: op[2]]])

    async def snapshot(self) -> Any:
        s = self.store
        rollouts, _ = await s.list_rollouts(limit=1000)
        finished = {sp: [f.group.group_id for f in await s.finished_groups(split=sp)] for sp in ("train", "eval")}
        attempts = [(a.status.value, a.index) for a in [await s.get_attempt(x) for x in self.attempts]]
        rows = [(r.group_id, r.status.value, r.attempts_used, r.max_attempts, r.split) for r in rollouts]
        groups, _ = await s.list_group_details(split=None, limit=1000)
        listed = [(g.group.group_id, g.group.consumed_step, [d.rollout.status.value for d in g.rollouts])
                  for g in groups]  # fmt: skip
        return rows, attempts, finished, listed, await s.counts()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(OPS, min_size=1, max_size=25))
def test_memory_and_sqlite_agree(ops: list[tuple[Any, ...]]) -> None:
    async def run() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            memory, sqlite = MemoryStore(), SQLiteStore(Path(tmp) / "m.db")
            a, b = Driver(memory), Driver(sqlite)
            try:
                for op in ops:
                    assert await a.apply(op) == await b.apply(op), op
                    assert await a.snapshot() == await b.snapshot(), op
            finally:
                await sqlite.close()

    asyncio.run(run())
