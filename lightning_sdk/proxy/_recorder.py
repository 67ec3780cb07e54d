"""Write calls and rewards to the store off the request path, in batches, with back-pressure.

Request handlers ``await recorder.add_call(call)``: that only appends the call to a list (it waits when
``max_pending`` items are already waiting — back-pressure instead of unbounded memory when the store is slow; a
plain list and a future that wakes the writer: 0.75 vs 1.1 us a call with an ``asyncio.Queue``). One background
task takes what is queued (lingering ``linger_s``, 50 ms by default, for more to arrive, up to ``max_batch``: a
transaction costs far more than a row, so fewer, larger batches cut the proxy's CPU), commits it with one
``record_calls`` and one ``record_rewards``, and counts it done per attempt. ``flush(attempt_id)`` is the durability
barrier of ``finish``: it skips the linger, returns once every call and reward queued for that attempt before it was
called is committed, and raises ``StoreError`` if one of them could not be written. ``drain()``
does the same for everything queued.

A failing batch is retried (``lightning_sdk._retry``) while the store says it is unavailable; otherwise its items are
written one by one so that one bad item (say, a call for an attempt the store does not know) does not lose the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict

from lightning_sdk._retry import RetryPolicy, retry
from lightning_sdk.errors import LightningSDKError, StoreError, StoreUnavailableError
from lightning_sdk.monitoring import OpsMetrics
from lightning_sdk.store.base import Store
from lightning_sdk.types import Call, Reward

__all__ = ["Recorder"]

logger = logging.getLogger(__name__)


class Recorder:
    """Batched, bounded, background writer of calls and rewards (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        *,
        max_pending: int = 4096,
        max_batch: int = 256,
        linger_s: float = 0.05,
        retries: int = 3,
        retry_s: float = 0.2,
        metrics: OpsMetrics | None = None,
    ) -> None:
        self.store = store
        self.metrics = metrics  # batch write seconds, items written, store errors; the queue depth at scrape
        if metrics is not None:
            metrics.queue_depth_from(lambda: self.pending)
        self.linger_s = linger_s
        self._urgent = asyncio.Event()  # set by flush/stop: write now, do not linger
        self.max_batch = max_batch
        self.retry_policy = RetryPolicy(retries=retries, backoff_s=retry_s)
        self.max_pending = max_pending
        self._buf: list[Call | Reward] = []  # queued, not yet taken by the writer (in order)
        self._has_items: asyncio.Future[None] | None = None  # the writer waits on it while nothing is queued
        self._space = asyncio.Event()  # set while fewer than max_pending items are queued
        self._space.set()
        self._queued: dict[str, int] = defaultdict(int)  # attempt id -> items queued so far
        self._done: dict[str, int] = defaultdict(int)  # attempt id -> items written (or given up on) so far
        self._n_queued = 0
        self._n_done = 0
        self._failed: dict[str, list[str]] = defaultdict(list)
        self._waiters: list[tuple[str | None, int, asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None
        self.written_calls = 0
        self.written_rewards = 0

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="lightning-sdk-recorder")

    async def drain(self, timeout: float = 30.0) -> None:
        """Wait until everything queued so far is written (all attempts)."""
        try:
            await asyncio.wait_for(self._wait_for(None, self._n_queued), timeout)
        except TimeoutError as exc:
            raise StoreUnavailableError(f"recorder: {self.pending} items not written within {timeout}s") from exc

    async def stop(self, timeout: float = 30.0) -> None:
        """Write everything queued, then stop the writer."""
        if self._task is None:
            return
        try:
            await self.drain(timeout)
        except StoreUnavailableError as exc:
            logger.error("at shutdown: %s", exc)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None

    @property
    def pending(self) -> int:
        """Items queued and not yet written."""
        return self._n_queued - self._n_done

    # -- producers -------------------------------------------------------------------------------------------------
    async def add_call(self, call: Call) -> None:
        """Queue a call; waits while ``max_pending`` items are already queued."""
        self._count(call.attempt_id)
        await self._put(call)

    async def add_reward(self, reward: Reward) -> None:
        self._count(reward.attempt_id)
        await self._put(reward)

    async def _put(self, item: Call | Reward) -> None:
        while len(self._buf) >= self.max_pending:  # back-pressure (rare: the store is behind)
            self._space.clear()
            await self._space.wait()
        self._buf.append(item)
        fut = self._has_items
        if fut is not None:
            self._has_items = None
            if not fut.done():
                fut.set_result(None)

    def _count(self, attempt_id: str) -> None:
        if self._task is None:
            self.start()
        self._queued[attempt_id] += 1
        self._n_queued += 1

    async def flush(self, attempt_id: str, timeout: float = 60.0) -> None:
        """Wait until everything queued for ``attempt_id`` is committed; raise ``StoreError`` if some was lost."""
        errors = await self.commit(attempt_id, timeout)
        if errors:
            raise StoreError(f"attempt {attempt_id}: {len(errors)} calls/rewards could not be recorded: {errors[0]}")

    async def commit(self, attempt_id: str, timeout: float = 60.0) -> list[str]:
        """Like ``flush``, but return what could not be recorded (``"call ID: why"`` / ``"reward NAME: why"``)."""
        target = self._queued.get(attempt_id, 0)
        try:
            await asyncio.wait_for(self._wait_for(attempt_id, target), timeout)
        except TimeoutError as exc:
            raise StoreUnavailableError(f"attempt {attempt_id}: calls not committed within {timeout}s") from exc
        if self._done.get(attempt_id, 0) >= self._queued.get(attempt_id, 0):
            self._queued.pop(attempt_id, None)
            self._done.pop(attempt_id, None)
        return self._failed.pop(attempt_id, None) or []

    async def settle(self, attempt_id: str, timeout: float = 60.0) -> None:
        """Wait until everything queued for ``attempt_id`` so far is written or given up on (before reading the
        attempt's calls from the store). Unlike ``commit`` it keeps what could not be recorded for the barrier."""
        try:
            await asyncio.wait_for(self._wait_for(attempt_id, self._queued.get(attempt_id, 0)), timeout)
        except TimeoutError as exc:
            raise StoreUnavailableError(f"attempt {attempt_id}: calls not committed within {timeout}s") from exc

    def pending_for(self, attempt_id: str) -> int:
        """Items of ``attempt_id`` queued and not yet written."""
        return self._queued.get(attempt_id, 0) - self._done.get(attempt_id, 0)

    def _reached(self, attempt_id: str | None, target: int) -> bool:
        done = self._n_done if attempt_id is None else self._done.get(attempt_id, 0)
        return done >= target

    async def _wait_for(self, attempt_id: str | None, target: int) -> None:
        if self._reached(attempt_id, target):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((attempt_id, target, fut))
        self._urgent.set()
        await fut

    # -- the writer ------------------------------------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._buf:
                fut = self._has_items = loop.create_future()
                try:
                    await fut
                finally:
                    self._has_items = None
            if self.linger_s > 0 and len(self._buf) < self.max_batch and not self._urgent.is_set():
                # let a few more calls arrive: one transaction for many calls costs far less CPU than many
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._urgent.wait(), self.linger_s)
            if not self._waiters:
                self._urgent.clear()
            buf = self._buf
            if len(buf) <= self.max_batch:
                batch, self._buf = buf, []
            else:
                batch, self._buf = buf[: self.max_batch], buf[self.max_batch :]
            if len(self._buf) < self.max_pending:
                self._space.set()
            try:
                await self._write(batch)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the writer die: the barrier would hang
                logger.exception("recorder: unexpected failure writing %d items", len(batch))
                for item in batch:
                    self._failed[item.attempt_id].append("unexpected recorder failure")
            done = self._done
            for item in batch:
                done[item.attempt_id] += 1
            self._n_done += len(batch)
            self._wake()

    def _wake(self) -> None:
        still = []
        for attempt_id, target, fut in self._waiters:
            if self._reached(attempt_id, target):
                if not fut.done():
                    fut.set_result(None)
            else:
                still.append((attempt_id, target, fut))
        self._waiters = still

    async def _write(self, batch: list[Call | Reward]) -> None:
        calls = [item for item in batch if isinstance(item, Call)]
        rewards = [item for item in batch if isinstance(item, Reward)]
        t0 = time.perf_counter()
        try:
            await retry(
                lambda: self._commit(calls, rewards),
                policy=self.retry_policy,
                retry_if=lambda exc: isinstance(exc, StoreUnavailableError),
                what=f"recorder: writing {len(batch)} calls/rewards",
            )
            if self.metrics is not None:
                self.metrics.record_written(time.perf_counter() - t0, len(calls), len(rewards))
            return
        except LightningSDKError as exc:
            logger.warning("recorder: batch write failed (%s); writing its items one by one", exc)
            if self.metrics is not None:
                self.metrics.store_error("record_batch")
        for item in batch:  # isolate the bad item(s)
            await self._write_one(item)

    async def _commit(self, calls: list[Call], rewards: list[Reward]) -> None:
        if calls:
            await self.store.record_calls(calls)
            self.written_calls += len(calls)
        if rewards:
            await self.store.record_rewards(rewards)
            self.written_rewards += len(rewards)

    async def _write_one(self, item: Call | Reward) -> None:
        t0 = time.perf_counter()
        try:
            if isinstance(item, Call):
                await self._commit([item], [])
            else:
                await self._commit([], [item])
            if self.metrics is not None:
                is_call = isinstance(item, Call)
                self.metrics.record_written(time.perf_counter() - t0, int(is_call), int(not is_call))
        except LightningSDKError as exc:
            if self.metrics is not None:
                self.metrics.store_error("record_item")
            what = f"call {item.call_id}" if isinstance(item, Call) else f"reward {item.name!r}"
            logger.error("recorder: could not record %s of attempt %s: %s", what, item.attempt_id, exc)
            self._failed[item.attempt_id].append(f"{what}: {exc}")
