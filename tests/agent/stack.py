"""A real tracing stack for agent tests: the mock OpenAI upstream (uvicorn on loopback) behind the real proxy app
(``create_app`` with the passthrough backend, uvicorn on loopback) over a real SQLite store file.

``proxy_stack`` serves the proxy on the test's own event loop (so a ``WorkerPool`` can share the ``SQLiteStore``
object, as ``lightning-sdk train`` does in process); ``threaded_proxy_stack`` serves it from a background thread
(for tests that run the CLI, which owns its own loop)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_sdk.proxy.app import create_app
from lightning_sdk.proxy.passthrough import PassthroughBackend
from lightning_sdk.store import SQLiteStore
from lightning_sdk.types import RolloutDetail
from tests.support.mock_openai import EOS_ID, MockOpenAI, encode, logprob_of
from tests.support.servers import RunningServer, run_server, serve_async

ADMIN_KEY = "agent-tests-admin-key"


@dataclass
class Stack:
    store: SQLiteStore
    url: str  # the proxy root (no /v1)
    mock: MockOpenAI
    server: RunningServer
    admin_key: str = ADMIN_KEY


def _app(store: SQLiteStore, upstream_url: str) -> Any:
    return create_app(store, policy_backend=PassthroughBackend(f"{upstream_url}/v1"), admin_key=ADMIN_KEY)


@contextlib.asynccontextmanager
async def proxy_stack(tmp_path: Path, mock: MockOpenAI | None = None) -> AsyncIterator[Stack]:
    mock = mock or MockOpenAI()
    store = SQLiteStore(tmp_path / "store.db")
    try:
        with run_server(mock.app) as upstream:
            async with serve_async(_app(store, upstream.url)) as srv:
                yield Stack(store, srv.url, mock, srv)
    finally:
        await store.close()


@contextlib.contextmanager
def threaded_proxy_stack(tmp_path: Path, mock: MockOpenAI | None = None) -> Iterator[Stack]:
    mock = mock or MockOpenAI()
    store = SQLiteStore(tmp_path / "store.db")
    with run_server(mock.app) as upstream, run_server(_app(store, upstream.url)) as srv:
        try:
            yield Stack(store, srv.url, mock, srv)
        finally:
            srv.call(store.close())


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
