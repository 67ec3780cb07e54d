"""The public surface of lightning_sdk.store stays what other parts code against."""

from __future__ import annotations

import lightning_sdk.store as store_pkg
from lightning_sdk.store import HTTPStore, MemoryStore, SQLiteStore, Store


def test_exported_members() -> None:
    assert sorted(store_pkg.__all__) == [
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
    assert all(hasattr(store_pkg, name) for name in store_pkg.__all__)


def test_every_store_implements_the_whole_protocol() -> None:
    protocol = {n for n in vars(Store) if not n.startswith("_")}
    assert {"claim", "finish_attempt", "get_attempt", "consume_groups"} <= protocol
    for cls in (MemoryStore, SQLiteStore, HTTPStore):
        missing = sorted(n for n in protocol if not callable(getattr(cls, n, None)))
        assert missing == [], (cls.__name__, missing)
