"""Session-wide fixtures shared by several test folders: one real PostgreSQL server per test session, and the pinned
real coding-agent CLIs from npm (``cli_bin``, for the ``real_cli`` tests of tests/surfaces and tests/examples)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from tests.support.postgres import PostgresServer
from tests.support.real_cli import cli_bin  # noqa: F401 (a fixture, found by its name)

_db_numbers = itertools.count()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A PostgreSQL server started for this session (``initdb`` + ``pg_ctl`` as the ``postgres`` user in a temporary
    directory), stopped and removed at the end. Skips, saying why, only where no server binary exists at all."""
    bin_dir = PostgresServer.find()
    if bin_dir is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl) on this machine: set $LSDK_PG_BIN")
    server = PostgresServer(bin_dir).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> Iterator[str]:
    """The URL of a fresh, empty database on the session's server (dropped after the test)."""
    name = f"lsdk_test_{next(_db_numbers)}"
    url = postgres_server.create_db(name)
    try:
        yield url
    finally:
        postgres_server.drop_db(name)
