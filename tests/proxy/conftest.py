"""Fixtures for the proxy tests: a loopback mock engine (vLLM wire format) and the real proxy in front of it,
recording into a real SQLite file in tmp_path. Everything runs over real HTTP on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.mock_openai import MockOpenAI
from tests.support.proxy import ProxyHandle, run_proxy
from tests.support.servers import RunningServer, run_server


@pytest.fixture
def mock() -> MockOpenAI:
    return MockOpenAI()


@pytest.fixture
def upstream(mock: MockOpenAI) -> Iterator[RunningServer]:
    with run_server(mock.app) as server:
        yield server


@pytest.fixture
def px(upstream: RunningServer, tmp_path: Path) -> Iterator[ProxyHandle]:
    with run_proxy(upstream.url + "/v1", store_path=tmp_path / "store.db") as handle:
        yield handle
