"""The job's proxy server: token mode over the serving engine, recording into the store, on a socket bound first.

``bind_socket`` (``lightning_sdk/listen.py``) runs before the slow policy set-up, so a bad or busy port fails at
once; ``ProxyServer.start`` serves ``create_app`` (token mode over the engine, with the job's per-split sampling) on
that socket with uvicorn and publishes the policy's URL as a store resource; ``stop`` is called last, after the
workers are done (``serving``: both, as a context).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import uvicorn
from starlette.routing import BaseRoute, Mount

from lightning_sdk.engines.base import Engine
from lightning_sdk.errors import TrainerError
from lightning_sdk.listen import bind_socket, free_port
from lightning_sdk.monitoring import OpsMetrics
from lightning_sdk.proxy.sampling import SplitSampling
from lightning_sdk.store.base import Store
from lightning_sdk.telemetry import Telemetry
from lightning_sdk.types import Resource

__all__ = ["UI_PATH", "ProxyServer", "bind_socket", "free_port"]

UI_PATH = "/lightning/v1/ui"
"""Where the job's proxy serves the run viewer (admin key: bearer, or ``?key=`` once in a browser)."""

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the job decides what SIGINT/SIGTERM do (stop the workers, finish the
    step, write the checkpoint), and the proxy stops last."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class ProxyServer:
    """The proxy of a job on ``sock`` (bound by ``bind_socket``); ``url`` is known before it serves."""

    def __init__(self, sock: socket.socket, host: str) -> None:
        self.sock = sock
        self.host = host
        self.port = int(sock.getsockname()[1])
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"  # known after the socket closed too

    @contextlib.asynccontextmanager
    async def serving(self, store: Store, engine: Engine, tokenizer: object, **options: Any) -> AsyncIterator[None]:
        """``start`` (same arguments), yield while it serves, ``stop`` whatever happens: the job's proxy, which
        stops last of what serves (the workers are done or released their attempts by then)."""
        try:
            await self.start(store, engine, tokenizer, **options)
            yield
        finally:
            await self.stop()

    async def start(
        self,
        store: Store,
        engine: Engine,
        tokenizer: object,
        *,
        admin_key: str,
        sampling: SplitSampling | None,
        model_name: str = "policy",
        metrics: OpsMetrics | None = None,
        run_dir: Path | None = None,
        publish: bool = True,
        telemetry: Telemetry | None = None,
    ) -> None:
        """Serve the proxy (token mode over ``engine``, ``sampling`` per split; ``metrics`` at ``GET /metrics``)
        and publish it as a resource; with ``run_dir``, the run viewer at ``/lightning/v1/ui`` too (behind the
        admin key); ``telemetry``: the proxy's call and attempt spans. ``publish=False``: not published as the
        policy's resource (a cluster's extra proxies)."""
        from lightning_sdk.app.policies import PolicyEngines
        from lightning_sdk.proxy import PolicyBackend, ProxyConfig, create_app
        from lightning_sdk.proxy.router import PolicyRouter
        from lightning_sdk.proxy.serve import uvicorn_config
        from lightning_sdk.proxy.token_mode import TokenModeBackend, TokenModeConfig
        from lightning_sdk.tokens import ChatRenderer

        # the policy's renderer (``app/parts.py``: its template probed and chosen), or one from a bare tokenizer
        renderer = tokenizer if isinstance(tokenizer, ChatRenderer) else ChatRenderer.for_policy(tokenizer)
        backend: PolicyBackend
        config: ProxyConfig | None = None
        if isinstance(engine, PolicyEngines):  # several policies: each request's model names its policy
            backend = PolicyRouter(
                {
                    name: TokenModeBackend(one, renderer, config=TokenModeConfig(model_name=name, sampling=sampling))
                    for name, one in engine.policies.items()
                }
            )
            config = ProxyConfig(policy_models=list(engine.policies))  # any other name: 404, recorded
        else:
            backend = TokenModeBackend(
                engine, renderer, config=TokenModeConfig(model_name=model_name, sampling=sampling)
            )
        extra: list[BaseRoute] = []
        if run_dir is not None:
            from lightning_sdk.viewer import RunData, create_viewer_app

            viewer = create_viewer_app(RunData(run_dir, store, tokenizer=renderer.tokenizer), admin_key=admin_key)
            extra.append(Mount(UI_PATH, app=viewer))
        observers = []
        if telemetry is not None:
            from lightning_sdk.telemetry.observer import SpanObserver

            observers.append(SpanObserver(telemetry))
        app = create_app(
            store,
            policy_backend=backend,
            admin_key=admin_key,
            config=config,
            metrics=metrics,
            extra_routes=extra,
            observers=observers,
        )
        self._server = _Server(uvicorn_config(app, self.host, self.port, loop="asyncio"))
        self._task = asyncio.create_task(self._server.serve(sockets=[self.sock]))
        server, task = self._server, self._task
        while not server.started:  # uvicorn flags ``started`` without an event to wait on
            if task.done():
                raise TrainerError(f"the proxy could not start on {self.url}")
            await asyncio.sleep(0.02)
        if publish:
            await store.set_resource(Resource(name=model_name, base_url=self.url + "/v1", kind="embedded"))

    async def stop(self) -> None:
        """Stop serving (call it last: after the workers have finished or released their attempts)."""
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._server = None
        self.close_socket()

    def close_socket(self) -> None:
        self.sock.close()
