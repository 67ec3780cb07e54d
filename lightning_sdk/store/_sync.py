"""``run_sync``: run one store coroutine from synchronous code (CLI commands, scripts)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["run_sync"]

T = TypeVar("T")


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """The result of ``coro``: on a new event loop, or on a helper thread when this thread already runs one."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lsdk-run-sync") as pool:
        return pool.submit(asyncio.run, coro).result()
