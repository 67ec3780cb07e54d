"""Run the real tracing proxy on loopback in front of an upstream, for tests of anything that talks to it.

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
``policy_backend``; the store is a ``SQLiteStore`` at ``store_path``, or ``MemoryStore`` when no path is given.
"""

from __future__ import annotations

import contextlib
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx

from lightning_sdk.proxy import PassthroughBackend, PolicyBackend, ProxyConfig, create_app
from lightning_sdk.proxy.external import ExternalRoute
from lightning_sdk.store import MemoryStore, SQLiteStore, Store
from tests.support.servers import RunningServer, run_server

__all__ = ["ADMIN_KEY", "ProxyHandle", "run_proxy"]

ADMIN_KEY = "test-admin-key"
T = TypeVar("T")


class ProxyHandle:
    """A running proxy: ``url`` (no trailing slash), ``store``, ``app`` and small helpers for its endpoints."""

    def __init__(self, server: RunningServer, store: Store, app: Any) -> None:
        self.server = server
        self.url = server.url
        self.store = store
        self.app = app
        self.admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
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


@contextlib.contextmanager
def run_proxy(
    upstream: str | None = None,
    *,
    policy_backend: PolicyBackend | None = None,
    store: Store | None = None,
    store_path: Path | str | None = None,
    external: list[ExternalRoute] | None = None,
    config: ProxyConfig | None = None,
    **backend_options: Any,
) -> Iterator[ProxyHandle]:
    """Serve ``create_app`` on a free loopback port (see the module docstring)."""
    if policy_backend is None:
        if upstream is None:
            raise ValueError("run_proxy needs an upstream URL or a policy_backend")
        options: dict[str, Any] = {"backoff_s": 0.01, "backoff_max_s": 0.05, "timeout_s": 10.0}
        options.update(backend_options)
        policy_backend = PassthroughBackend(upstream, **options)
    if store is None:
        store = SQLiteStore(Path(store_path)) if store_path is not None else MemoryStore()
    app = create_app(store, policy_backend=policy_backend, admin_key=ADMIN_KEY, external=external, config=config)
    with run_server(app) as server:
        handle = ProxyHandle(server, store, app)
        try:
            yield handle
        finally:
            handle.http.close()
