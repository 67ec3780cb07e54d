"""The one loopback proxy harness: the real tracing proxy (``create_app``) on a free 127.0.0.1 port in front of an
upstream or a policy backend, over a real store, with the one test ``ADMIN_KEY``. Every test that needs a proxy uses
it (proxy, surfaces, tokens, agent, trainer tests).

::

    mock = MockOpenAI()
    with run_server(mock.app) as upstream, run_proxy(upstream.url + "/v1", store_path=tmp_path / "s.db") as px:
        s = px.session({"q": 1})                       # POST /lightning/v1/sessions -> rollout, attempt, token
        client = openai.OpenAI(base_url=px.url + "/v1", api_key=s["token"])
        ...
        px.finish(s["token"])                          # POST /lightning/v1/finish (the durability barrier)
        px.rollout(s["rollout_id"])                    # GET /lightning/v1/rollouts/{id} (the contract's JSON)
        px.call(px.store.get_rollout(...))             # or read the store directly, on the proxy's loop

``run_proxy`` takes an upstream URL (a ``PassthroughBackend`` with fast test retries is built) or any
``policy_backend``; the store is ``store``, else a ``SQLiteStore`` at ``store_path`` (closed on exit), else a
``MemoryStore``. It serves from a background thread (sync tests, the sync ``openai`` client, CLIs in
subprocesses). ``serve_proxy`` is the same on the test's own event loop (async tests that share the store object
with in-process workers, as ``lightning-sdk train`` does)::

    async with serve_proxy(upstream.url + "/v1", store_path=tmp_path / "s.db") as px:
        client = openai.AsyncOpenAI(base_url=px.url + "/v1", api_key=token)
        await px.drain()

``proxy_app`` builds the app alone (the admin key is ``ADMIN_KEY``), for tests that serve it themselves.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from lightning_sdk.proxy import PassthroughBackend, PolicyBackend, ProxyConfig, create_app
from lightning_sdk.proxy._external import ExternalRoute
from lightning_sdk.proxy.observe import CallObserver
from lightning_sdk.store import MemoryStore, SQLiteStore, Store, run_sync
from tests.support.servers import RunningServer, run_server, serve_async

__all__ = ["ADMIN_KEY", "AsyncProxy", "ProxyHandle", "proxy_app", "run_proxy", "serve_proxy"]

ADMIN_KEY = "test-admin-key"
"""The admin key of every test proxy (and of the test store servers)."""
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_KEY}"}
T = TypeVar("T")

#: what ``run_proxy``'s passthrough backend gets unless told otherwise: fast retries for tests
FAST_RETRIES: dict[str, Any] = {"backoff_s": 0.01, "backoff_max_s": 0.05, "timeout_s": 10.0}


def proxy_app(
    store: Store,
    upstream: str | None = None,
    *,
    policy_backend: PolicyBackend | None = None,
    external: list[ExternalRoute] | None = None,
    config: ProxyConfig | None = None,
    observers: Sequence[CallObserver] = (),
    **backend_options: Any,
) -> Any:
    """``create_app`` with ``ADMIN_KEY``: ``policy_backend``, or a ``PassthroughBackend`` to ``upstream`` (built
    with ``backend_options``); ``observers`` watch its calls (``lightning_sdk.proxy.observe``)."""
    if policy_backend is None:
        if upstream is None:
            raise ValueError("a test proxy needs an upstream URL or a policy_backend")
        policy_backend = PassthroughBackend(upstream, **backend_options)
    return create_app(
        store,
        policy_backend=policy_backend,
        admin_key=ADMIN_KEY,
        external=external,
        config=config,
        observers=observers,
    )


def _store(store: Store | None, store_path: Path | str | None) -> tuple[Store, bool]:
    """(the store, whether the harness opened it and so closes it)."""
    if store is not None:
        return store, False
    if store_path is not None:
        return SQLiteStore(Path(store_path)), True
    return MemoryStore(), False


class ProxyHandle:
    """A running proxy: ``url`` (no trailing slash), ``store``, ``app`` and small helpers for its endpoints."""

    def __init__(self, server: RunningServer, store: Store, app: Any) -> None:
        self.server = server
        self.url = server.url
        self.store = store
        self.app = app
        self.admin = dict(ADMIN_HEADERS)
        self.http = httpx.Client(base_url=self.url, timeout=30.0)

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine (e.g. a store read) on the proxy's event loop."""
        return self.server.call(coro)

    def session(self, task: dict[str, Any] | None = None, group: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {}
        if task is not None:
            body["task"] = task
        if group is not None:
            body["group"] = group
        r = self.http.post("/lightning/v1/sessions", json=body, headers=self.admin)
        r.raise_for_status()
        data: dict[str, Any] = r.json()
        return data

    def reward(self, token: str, value: float, name: str | None = None, call_id: str | None = None) -> httpx.Response:
        body: dict[str, Any] = {"value": value}
        if name is not None:
            body["name"] = name
        if call_id is not None:
            body["call_id"] = call_id
        return self.http.post("/lightning/v1/reward", json=body, headers={"Authorization": f"Bearer {token}"})

    def finish(self, token: str, status: str = "succeeded", error: str | None = None) -> httpx.Response:
        body: dict[str, Any] = {"status": status}
        if error is not None:
            body["error"] = error
        return self.http.post("/lightning/v1/finish", json=body, headers={"Authorization": f"Bearer {token}"})

    def drain(self) -> None:
        """Wait until every call and reward the proxy has received so far is committed to the store."""
        self.call(self.app.state.proxy.recorder.drain())

    def rollout(self, rollout_id: str, *, drain: bool = True) -> dict[str, Any]:
        """``GET /lightning/v1/rollouts/{id}`` (after ``drain()`` unless told not to)."""
        if drain:
            self.drain()
        r = self.http.get(f"/lightning/v1/rollouts/{rollout_id}", headers=self.admin)
        r.raise_for_status()
        data: dict[str, Any] = r.json()
        return data

    def calls(self, rollout_id: str) -> list[dict[str, Any]]:
        """Every call of the rollout (all attempts), in order, as the contract's JSON."""
        return [c for a in self.rollout(rollout_id)["attempts"] for c in a["calls"]]


def _serving_protocol(app: Any) -> type[Any]:
    """The HTTP protocol ``lightning-sdk proxy`` and the trainer serve the proxy with (``serve.uvicorn_config``): the
    tests run on what users run, not on uvicorn's default protocol."""
    from lightning_sdk.proxy.serve import header_timeout_protocol

    return header_timeout_protocol(app.proxy.config.read_timeout_s)


@contextlib.contextmanager
def run_proxy(
    upstream: str | None = None,
    *,
    policy_backend: PolicyBackend | None = None,
    store: Store | None = None,
    store_path: Path | str | None = None,
    external: list[ExternalRoute] | None = None,
    config: ProxyConfig | None = None,
    observers: Sequence[CallObserver] = (),
    **backend_options: Any,
) -> Iterator[ProxyHandle]:
    """Serve the proxy from a background thread on a free loopback port (see the module docstring)."""
    the_store, owned = _store(store, store_path)
    options = {**FAST_RETRIES, **backend_options}
    app = proxy_app(
        the_store,
        upstream,
        policy_backend=policy_backend,
        external=external,
        config=config,
        observers=observers,
        **options,
    )
    try:
        with run_server(app, http=_serving_protocol(app)) as server:
            handle = ProxyHandle(server, the_store, app)
            try:
                yield handle
            finally:
                handle.http.close()
    finally:
        if owned:  # after the server stopped (its shutdown commits what the recorder holds)
            run_sync(the_store.close())


@dataclass
class AsyncProxy:
    """A proxy served on the test's event loop: ``url`` (no trailing slash), ``store``, ``app``, ``server``."""

    url: str
    store: Store
    app: Any
    server: RunningServer
    admin: dict[str, str] = field(default_factory=lambda: dict(ADMIN_HEADERS))

    async def drain(self) -> None:
        """Wait until every call and reward received so far is committed to the store."""
        await self.app.state.proxy.recorder.drain()


@contextlib.asynccontextmanager
async def serve_proxy(
    upstream: str | None = None,
    *,
    policy_backend: PolicyBackend | None = None,
    store: Store | None = None,
    store_path: Path | str | None = None,
    external: list[ExternalRoute] | None = None,
    config: ProxyConfig | None = None,
    observers: Sequence[CallObserver] = (),
    **backend_options: Any,
) -> AsyncIterator[AsyncProxy]:
    """``run_proxy`` on the running event loop (the passthrough backend as given: no test retry defaults)."""
    the_store, owned = _store(store, store_path)
    app = proxy_app(
        the_store,
        upstream,
        policy_backend=policy_backend,
        external=external,
        config=config,
        observers=observers,
        **backend_options,
    )
    try:
        async with serve_async(app, http=_serving_protocol(app)) as server:
            yield AsyncProxy(server.url, the_store, app, server)
    finally:
        if owned:
            await the_store.close()
