"""Wait for an observable state instead of sleeping and hoping: the condition is checked until it holds, and the
timeout is only an upper bound that fails the test (a slow machine waits longer, a fast one does not wait)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["until", "until_async"]


def until(condition: Callable[[], bool], *, timeout: float = 60.0, what: str = "the condition") -> None:
    """Block until ``condition()`` is true; ``AssertionError`` naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.005)


async def until_async(condition: Callable[[], bool], *, timeout: float = 60.0, what: str = "the condition") -> None:
    """``until`` for async tests: yields to the event loop between checks."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.002)
