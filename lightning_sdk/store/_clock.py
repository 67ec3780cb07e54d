"""The store's clock: what "now" is for leases, timeouts and heartbeats.

A store takes ``clock`` (default ``lightning_sdk.types.now``, wall-clock seconds) and reads the time only through
it, so a test drives leases with a ``ManualClock`` instead of sleeping and hoping the machine is fast enough::

    clock = ManualClock()
    store = MemoryStore(clock=clock)
    claim = await store.claim("w", lease_s=30)
    clock.advance(31)
    assert await store.expire_leases()   # the lease is over, whatever the machine's speed
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from lightning_sdk.types import now

__all__ = ["Clock", "ManualClock", "system_clock"]

Clock = Callable[[], float]
"""Seconds since the epoch, as ``time.time()``."""

system_clock: Clock = now


class ManualClock:
    """A clock that moves only when told to (``advance``/``set``); safe to read from the store's threads."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._t = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._t

    def advance(self, seconds: float) -> float:
        """Move the clock forward by ``seconds``; returns the new time."""
        if seconds < 0:
            raise ValueError("a clock does not go back")
        with self._lock:
            self._t += seconds
            return self._t
