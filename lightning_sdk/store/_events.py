"""``AttemptEnds``: an in-process store's signal that attempts ended, so a waiter wakes instead of polling.

A group finishes when the last attempt of its last rollout ends (finished by a worker or the proxy's barrier,
expired by ``expire_leases``, or cancelled). The in-process stores (``MemoryStore``, ``SQLiteStore``) bump
``store.attempt_ends`` at each of those moments; the trainer waits on it for finished groups and only then reads
them. ``HTTPStore`` has none (the changes happen in another process): its users keep a bounded poll.

Waiters may sit on any event loop (the proxy's server thread, the test's loop): ``bump`` wakes each on its own loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

__all__ = ["AttemptEnds"]


class AttemptEnds:
    """A count of ended attempts; ``wait(seen)`` returns once the count is no longer ``seen`` (or on timeout)."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    @property
    def waiting(self) -> int:
        """How many waiters are parked now (tests wait for this to know a waiter is asleep)."""
        return len(self._waiters)

    def bump(self, n: int = 1) -> None:
        """``n`` attempts ended (or may have: a spurious wake-up costs the waiter one read)."""
        if n <= 0:
            return
        with self._lock:
            self.count += n
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            with contextlib.suppress(RuntimeError):  # a loop closed meanwhile: nobody waits there any more
                loop.call_soon_threadsafe(_wake, fut)

    async def wait(self, seen: int, timeout: float | None) -> int:
        """Wait until ``count != seen`` or ``timeout`` seconds passed; returns the count."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self.count != seen:
                return self.count
            self._waiters.append((loop, fut))
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(fut, timeout)
        finally:
            with self._lock, contextlib.suppress(ValueError):
                self._waiters.remove((loop, fut))
        return self.count


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
