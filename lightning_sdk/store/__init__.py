"""The store: tasks, groups, rollouts, attempts, calls and rewards behind one async interface.

``MemoryStore`` (tests), ``SQLiteStore`` (one WAL file, the embedded default) and ``HTTPStore`` (the same API
served by ``store_routes`` at ``/lightning/v1/store``); ``open_store(spec)`` picks one from a string. See
docs/store.md.
"""

from typing import TYPE_CHECKING, Any

from lightning_sdk.store._clock import Clock, ManualClock
from lightning_sdk.store._events import AttemptEnds
from lightning_sdk.store._open import ADMIN_KEY_ENV, open_store, redact_url
from lightning_sdk.store._reaper import reap_leases
from lightning_sdk.store._sync import run_sync
from lightning_sdk.store.base import Store
from lightning_sdk.store.http_client import HTTPStore
from lightning_sdk.store.loader import iter_group_pages, load_groups
from lightning_sdk.store.memory import MemoryStore
from lightning_sdk.store.sqlite import SQLiteStore
from lightning_sdk.types import FinishedGroup

if TYPE_CHECKING:
    from lightning_sdk.store.http_server import store_routes


def __getattr__(name: str) -> Any:
    """``store_routes`` is imported when asked for: the server side (starlette) stays out of a process that only
    uses a store client (an agent worker: ``import lightning_sdk.agent`` loads no server, tests/test_layers.py)."""
    if name == "store_routes":
        from lightning_sdk.store.http_server import store_routes

        return store_routes
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ADMIN_KEY_ENV",
    "AttemptEnds",
    "Clock",
    "FinishedGroup",
    "HTTPStore",
    "ManualClock",
    "MemoryStore",
    "SQLiteStore",
    "Store",
    "iter_group_pages",
    "load_groups",
    "open_store",
    "reap_leases",
    "redact_url",
    "run_sync",
    "store_routes",
]
