"""The public surface of lightning_sdk.store stays what other parts code against."""

from __future__ import annotations

import asyncio
from pathlib import Path

import lightning_sdk.store as store_pkg
from lightning_sdk.store import AttemptEnds, HTTPStore, MemoryStore, SQLiteStore, Store


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


def test_every_store_implements_the_whole_protocol(tmp_path: Path) -> None:
    protocol = {n for n in vars(Store) if not n.startswith("_")}
    assert {"claim", "finish_attempt", "get_attempt", "consume_groups"} <= protocol
    data = {n for n in protocol if isinstance(vars(Store)[n], property)}  # members read, not called
    assert data == {"attempt_ends"}
    for cls in (MemoryStore, SQLiteStore, HTTPStore):
        missing = sorted(n for n in protocol - data if not callable(getattr(cls, n, None)))
        assert missing == [], (cls.__name__, missing)
    # the in-process stores signal ended attempts; the HTTP store cannot see them (the trainer polls it)
    assert isinstance(MemoryStore().attempt_ends, AttemptEnds)
    sqlite = SQLiteStore(tmp_path / "store.db")
    try:
        assert isinstance(sqlite.attempt_ends, AttemptEnds)
    finally:
        asyncio.run(sqlite.close())
    assert HTTPStore.attempt_ends is None
