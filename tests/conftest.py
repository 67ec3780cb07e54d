"""Session-wide fixtures shared by several test folders: one real PostgreSQL server per test session, and the pinned
real coding-agent CLIs from npm (``cli_bin``, for the ``real_cli`` tests of tests/surfaces and tests/examples)."""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterator

import pytest

from tests.support.postgres import PostgresServer
from tests.support.real_cli import cli_bin  # noqa: F401 (a fixture, found by its name)

_db_numbers = itertools.count()

#: the markers of the long stages: a selection that asks for any of them runs in one process
LONG_MARKERS = ("slow", "harness", "real_cli", "vllm", "ray_cluster", "browser")


def workers_for(markexpr: str, cores: int) -> int:
    """pytest-xdist workers for ``-n auto`` (pyproject's addopts): one per core, at most two, for the default
    selection, whose tests mostly wait on subprocesses and servers (serially the 2-core machine's load average stays
    near 1); none (one process, no distribution) when ``-m`` selects a long stage (``-m slow``, ``-m vllm``...):
    those runs time themselves, or use every core, and CI runs each stage alone."""
    for marker in LONG_MARKERS:  # every long marker excluded ("not slow and ..."), none selected
        if not re.search(rf"\bnot {marker}\b", markexpr) or re.search(rf"(?<!not )\b{marker}\b", markexpr):
            return 0
    return max(1, min(2, cores))


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    env = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if env:
        return int(env)
    return workers_for(str(config.option.markexpr or ""), os.cpu_count() or 1)


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
