"""Serving the viewer: in the foreground (``lightning-sdk view``) or on a thread beside a run (``train --view``).

Both bind the socket first (a busy port is a one-line ``ConfigError``) and serve ``create_viewer_app`` with uvicorn;
the thread variant runs its own event loop, so the viewer's reads never wait on the training loop's.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import uvicorn

from lightning_sdk.errors import ConfigError
from lightning_sdk.listen import bind_socket
from lightning_sdk.viewer.app import create_viewer_app
from lightning_sdk.viewer.data import open_run

__all__ = ["ViewerThread", "bind", "serve_viewer"]


def bind(host: str, port: int) -> socket.socket:
    """The viewer's socket, listening at once (connections wait in the backlog until uvicorn serves)."""
    return bind_socket(host, port, backlog=128, who="the viewer")


def _url(host: str, sock: socket.socket) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{sock.getsockname()[1]}/"


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the caller owns SIGINT/SIGTERM
        yield


def _config(app: object, host: str) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, log_level="warning", lifespan="off", loop="asyncio")  # type: ignore[arg-type]


def serve_viewer(
    run_dir: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 4800,
    tokenizer_dir: str | Path | None = None,
    announce: Callable[[str], object] = print,
) -> None:
    """Serve the viewer of ``run_dir`` until interrupted (Ctrl-C)."""
    data = open_run(run_dir, tokenizer_dir=tokenizer_dir)
    data.tokenizer()  # loaded before serving, so the first rollout page does not wait for it
    sock = bind(host, port)
    announce(f"run viewer of {run_dir} on {_url(host, sock)} (read-only; Ctrl-C to stop)")
    server = uvicorn.Server(_config(create_viewer_app(data), host))

    async def main() -> None:
        try:
            await server.serve(sockets=[sock])
        finally:
            await data.store.close()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
    sock.close()


class ViewerThread:
    """The viewer of ``run_dir`` on a daemon thread with its own event loop; ``url`` is known once bound. The store
    is opened on first use (a run creates ``store.db`` after the viewer starts)."""

    def __init__(self, run_dir: str | Path, *, host: str = "127.0.0.1", port: int = 4800) -> None:
        self.run_dir = Path(run_dir)
        self.host = host
        self.sock = bind(host, port)
        self.url = _url(host, self.sock)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> ViewerThread:
        app = _LazyRun(self.run_dir)
        self._server = _Server(_config(app, self.host))
        server, sock = self._server, self.sock

        def run() -> None:
            async def main() -> None:
                try:
                    await server.serve(sockets=[sock])
                finally:
                    await app.close()

            asyncio.run(main())

        self._thread = threading.Thread(target=run, name="lightning-sdk-viewer", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.sock.close()


class _LazyRun:
    """An ASGI app that opens the run on its first request (503 until ``store.db`` exists)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._app: object = None
        self._data: object = None

    async def __call__(self, scope: dict[str, object], receive: object, send: object) -> None:
        if self._app is None:
            if scope["type"] != "http":
                return
            try:
                data = open_run(self.run_dir)
            except ConfigError as exc:
                from starlette.responses import PlainTextResponse

                await PlainTextResponse(f"the run is starting: {exc}", status_code=503)(scope, receive, send)  # type: ignore[arg-type]
                return
            self._data, self._app = data, create_viewer_app(data)
        await self._app(scope, receive, send)  # type: ignore[operator]

    async def close(self) -> None:
        if self._data is not None:
            await self._data.store.close()  # type: ignore[attr-defined]
