"""Fixtures for the store tests: the same behavioural tests run over every store implementation.

``store`` is parametrised over ``memory``, ``sqlite`` (a real file in tmp_path), ``http`` (a real uvicorn server
on a free loopback port serving ``store_routes`` over a SQLiteStore file, used through ``HTTPStore``) and
``postgres`` (a fresh database on the session's real PostgreSQL server, tests/conftest.py). ``durable`` is
the stores that keep their data across a reopen (``sqlite``, ``postgres``): ``reopen()`` gives a new object on the
same data. Every store
reads the time from ``clock`` (a ``ManualClock``), so lease tests move time instead of sleeping.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.routing import Mount

from lightning_sdk.store import ManualClock, MemoryStore, Store
from tests.support.proxy import ADMIN_KEY  # the one test key (tests/support/proxy.py)
from tests.support.waiting import until


def free_socket() -> socket.socket:
    """A bound loopback socket on a free port (handed to uvicorn, so there is no race for the port)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


class ServerThread:
    """A uvicorn server for ``store_routes(store)`` mounted at /lightning/v1/store, in a background thread."""

    def __init__(self, store: Store, sock: socket.socket | None = None) -> None:
        from lightning_sdk.store.http_server import store_routes

        app = Starlette(routes=[Mount("/lightning/v1/store", routes=store_routes(store, ADMIN_KEY))])
        self.sock = sock or free_socket()
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/lightning/v1/store"
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> ServerThread:
        self.thread.start()
        until(lambda: self.server.started, timeout=10, what="uvicorn to start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture(params=["memory", "sqlite", "http", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path, clock: ManualClock) -> AsyncIterator[Store]:
    kind: str = request.param
    if kind == "postgres":
        from lightning_sdk.store.postgres import PostgresStore

        s = PostgresStore(request.getfixturevalue("postgres_url"), clock=clock)
        yield s
        await s.close()
    elif kind == "memory":
        s: Store = MemoryStore(clock=clock)
        yield s
        await s.close()
    elif kind == "sqlite":
        from lightning_sdk.store.sqlite import SQLiteStore

        s = SQLiteStore(tmp_path / "store.db", clock=clock)
        yield s
        await s.close()
    else:
        from lightning_sdk.store.http_client import HTTPStore
        from lightning_sdk.store.sqlite import SQLiteStore

        backing = SQLiteStore(tmp_path / "store.db", clock=clock)
        server = ServerThread(backing).start()
        s = HTTPStore(server.url, ADMIN_KEY, timeout=10.0, retries=2)
        try:
            yield s
        finally:
            await s.close()
            server.stop()
            await backing.close()


class Durable:
    """A store that keeps its data across a reopen: ``open()`` makes a new store object on the same data."""

    def __init__(self, kind: str, where: str, clock: ManualClock) -> None:
        self.kind, self.where, self.clock = kind, where, clock

    def open(self) -> Store:
        if self.kind == "sqlite":
            from lightning_sdk.store.sqlite import SQLiteStore

            return SQLiteStore(self.where, clock=self.clock)
        from lightning_sdk.store.postgres import PostgresStore

        return PostgresStore(self.where, clock=self.clock)


@pytest.fixture(params=["sqlite", "postgres"])
def durable(request: pytest.FixtureRequest, tmp_path: Path, clock: ManualClock) -> Durable:
    if request.param == "sqlite":
        return Durable("sqlite", str(tmp_path / "store.db"), clock)
    return Durable("postgres", request.getfixturevalue("postgres_url"), clock)
