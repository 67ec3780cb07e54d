"""Wait for an observable state instead of sleeping and hoping: the condition is checked until it holds, and the
timeout is only an upper bound that fails the test (a slow machine waits longer, a fast one does not wait).

These two loops are the suite's one place that polls (``tests/test_no_sleeps.py`` counts every other sleep call): a
condition may assert (a subprocess that died, a server that exited) to fail at once instead of at the timeout, and
``until_async`` also awaits a condition that is a coroutine (a store read)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

import httpx

__all__ = ["answers", "until", "until_async"]


def answers(url: str, status: int = 200) -> bool:
    """Whether a GET of ``url`` answers ``status`` now (False while nothing listens yet): for ``until``."""
    try:
        return httpx.get(url, timeout=1.0).status_code == status
    except httpx.HTTPError:
        return False


def until(
    condition: Callable[[], bool], *, timeout: float = 60.0, what: str = "the condition", every: float = 0.005
) -> None:
    """Block until ``condition()`` is true, checking it every ``every`` seconds; ``AssertionError`` naming ``what``
    after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


async def until_async(
    condition: Callable[[], bool | Awaitable[bool]],
    *,
    timeout: float = 60.0,
    what: str = "the condition",
    every: float = 0.002,
) -> None:
    """``until`` for async tests: yields to the event loop between checks; ``condition`` may be async."""
    deadline = time.monotonic() + timeout
    while True:
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(every)
