"""Many proxies on one store: the calls of a shared store are committed before they are answered.

A store that several proxy processes share (``PostgresStore``: ``store.shared`` is True) serves the same attempts
through any of them, so the state one proxy kept in memory moves to the store:

* **numbering**: a call's ``seq`` comes from the attempt's row (``store.reserve_seq``), unique across proxies;
* **the finish barrier**: calls are recorded with ``running_only`` (the attempt's row is share-locked; a batch for
  an attempt that has ended is refused whole), and ``finish`` takes the row's exclusive lock, so it waits for the
  batches in flight, counts every call that landed (``store.finish_counting``), and no call lands after it;
* **durability before the answer**: ``CommitWriter.commit(call)`` returns once the call is committed, and only then
  is it answered (a non-streamed call; a streamed one is committed after its last content chunk and before the
  final event that ends its stream: ``finish_reason``, usage, ``[DONE]``). A proxy killed at any moment therefore
  never loses a call it answered: an agent that read a whole answer (a JSON body, or a stream up to its end) reads
  a committed call. A proxy killed between a stream's commit and its final event leaves the agent a stream cut off
  before its end (an error, never a silent success) and a committed call it did not use; its retry is a new call.

``CommitWriter`` commits in batches: every call queued while a batch commits goes into the next one (group commit:
one transaction per batch, however many handlers wait), so throughput does not stop at one round trip per call.
A batch refused because one of its attempts has ended is split per attempt, so the other attempts' calls land.
The single-process SQLite path does not use any of this (its barrier and numbering stay in the proxy's memory).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from typing import Protocol, runtime_checkable

from lightning_sdk._retry import RetryPolicy, retry
from lightning_sdk.errors import AttemptNotRunningError, LightningSDKError, StoreUnavailableError
from lightning_sdk.monitoring import OpsMetrics
from lightning_sdk.types import Attempt, AttemptStatus, Call

__all__ = ["CommitWriter", "SharedStore", "is_shared"]

logger = logging.getLogger(__name__)


@runtime_checkable
class SharedStore(Protocol):
    """What a store that many proxies share adds to ``Store`` (``PostgresStore``)."""

    shared: bool

    async def record_calls(self, calls: list[Call], *, running_only: bool = False) -> None: ...

    async def reserve_seq(self, attempt_id: str, n: int = 1) -> int: ...

    async def finish_counting(
        self, attempt_id: str, status: AttemptStatus, error: str | None = None
    ) -> tuple[Attempt, int]: ...


def is_shared(store: object) -> bool:
    return bool(getattr(store, "shared", False)) and isinstance(store, SharedStore)


class CommitWriter:
    """Commit calls in batches and tell each caller when its call is in the store (see the module docstring)."""

    def __init__(
        self,
        store: SharedStore,
        *,
        max_batch: int = 256,
        retries: int = 3,
        retry_s: float = 0.2,
        metrics: OpsMetrics | None = None,
    ) -> None:
        self.store = store
        self.metrics = metrics  # committed batches count as the recorder's do: write seconds, calls, store errors
        self.max_batch = max_batch
        self.retry_policy = RetryPolicy(retries=retries, backoff_s=retry_s)
        self._queue: list[tuple[Call, asyncio.Future[None]]] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.batches = 0
        self.written = 0

    def start(self) -> None:
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="lightning_sdk-commit-writer")

    async def stop(self) -> None:
        """Commit what is queued, then stop the writer."""
        task, self._task = self._task, None
        if task is None:
            return
        while self._queue:
            await asyncio.sleep(0.005)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def commit(self, call: Call) -> None:
        """Return once ``call`` is committed; ``AttemptNotRunningError`` if its attempt ended first (not recorded),
        ``StoreError`` if the store could not take it."""
        self.start()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((call, fut))
        assert self._wake is not None
        self._wake.set()
        await fut

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
                await self._write(batch)

    async def _write(self, batch: list[tuple[Call, asyncio.Future[None]]]) -> None:
        try:
            await self._record([c for c, _ in batch])
            _settle(batch, None)
        except AttemptNotRunningError:
            by_attempt: dict[str, list[tuple[Call, asyncio.Future[None]]]] = defaultdict(list)
            for item in batch:
                by_attempt[item[0].attempt_id].append(item)
            if len(by_attempt) == 1:
                _settle(batch, AttemptNotRunningError(f"attempt {batch[0][0].attempt_id} ended: call not recorded"))
                return
            for items in by_attempt.values():
                await self._write(items)
        except LightningSDKError as exc:
            logger.error("could not record %d calls: %s", len(batch), exc)
            _settle(batch, exc)
        except BaseException as exc:  # keep the writer alive; the callers get the error
            logger.exception("commit writer failed")
            _settle(batch, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def _record(self, calls: list[Call]) -> None:
        t0 = time.perf_counter()
        try:
            await retry(
                lambda: self.store.record_calls(calls, running_only=True),
                policy=self.retry_policy,
                retry_if=lambda exc: isinstance(exc, StoreUnavailableError),
                what=f"record {len(calls)} calls",
            )
        except AttemptNotRunningError:
            raise  # the barrier refused it (an ended attempt): not a store error
        except BaseException:
            if self.metrics is not None:
                self.metrics.store_error("record_batch")
            raise
        self.batches += 1
        self.written += len(calls)
        if self.metrics is not None:
            self.metrics.record_written(time.perf_counter() - t0, len(calls), 0)


def _settle(batch: list[tuple[Call, asyncio.Future[None]]], exc: BaseException | None) -> None:
    for _, fut in batch:
        if fut.done():
            continue
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)
