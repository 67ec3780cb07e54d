"""A real tracing stack for agent tests: the mock OpenAI upstream (uvicorn on loopback) behind the real proxy
(the one test harness, ``tests/support/proxy.py``, passthrough backend) over a real SQLite store file.

``proxy_stack`` serves the proxy on the test's own event loop (so a ``WorkerPool`` can share the ``SQLiteStore``
object, as ``lightning-sdk train`` does in process); ``threaded_proxy_stack`` serves it from a background thread
(for tests that run the CLI, which owns its own loop)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

from lightning_sdk.store import Clock, SQLiteStore, Store
from lightning_sdk.types import RolloutDetail
from tests.support.mock_openai import EOS_ID, MockOpenAI, encode, logprob_of
from tests.support.proxy import ADMIN_KEY, run_proxy, serve_proxy
from tests.support.servers import RunningServer, run_server

__all__ = ["ADMIN_KEY", "Stack", "assert_calls_traced", "proxy_stack", "threaded_proxy_stack"]


@dataclass
class Stack:
    store: Store
    url: str  # the proxy root (no /v1)
    mock: MockOpenAI
    server: RunningServer
    admin_key: str = ADMIN_KEY


@contextlib.asynccontextmanager
async def proxy_stack(
    tmp_path: Path, mock: MockOpenAI | None = None, *, clock: Clock | None = None
) -> AsyncIterator[Stack]:
    """``clock``: the store's clock (a ``ManualClock`` drives leases and heartbeats)."""
    mock = mock or MockOpenAI()
    store = SQLiteStore(tmp_path / "store.db", clock=clock) if clock is not None else SQLiteStore(tmp_path / "store.db")
    try:
        with run_server(mock.app) as upstream:
            async with serve_proxy(f"{upstream.url}/v1", store=store) as px:
                yield Stack(px.store, px.url, mock, px.server)
    finally:
        await store.close()


@contextlib.contextmanager
def threaded_proxy_stack(tmp_path: Path, mock: MockOpenAI | None = None) -> Iterator[Stack]:
    mock = mock or MockOpenAI()
    with run_server(mock.app) as upstream, run_proxy(f"{upstream.url}/v1", store_path=tmp_path / "store.db") as px:
        yield Stack(px.store, px.url, mock, px.server)


def assert_calls_traced(detail: RolloutDetail, min_calls: int = 1) -> None:
    """The succeeded attempt of ``detail`` has ``min_calls``+ calls, each with exactly the ids the mock produced."""
    ok = detail.succeeded_attempt()
    assert ok is not None, f"rollout {detail.rollout.rollout_id} did not succeed: {detail.rollout.status}"
    assert len(ok.calls) >= min_calls, f"{len(ok.calls)} calls recorded"
    for call in ok.calls:
        assert call.attempt_id == ok.attempt.attempt_id
        assert call.prompt_ids and call.completion_ids, call
        assert len(call.logprobs) == len(call.completion_ids)
        messages = call.request.get("messages")
        if messages is not None:
            reply = call.response["choices"][0]["message"]
            prompt_ids, _, _, _ = MockOpenAI.expected_ids(messages, "")
            assert call.prompt_ids == prompt_ids
            if reply.get("content"):
                assert call.completion_ids == [*encode(reply["content"]), EOS_ID]
            assert call.logprobs == [logprob_of(i) for i in range(len(call.completion_ids))]
