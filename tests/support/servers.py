"""Run any ASGI app with uvicorn on a free ``127.0.0.1`` port, for tests that need real HTTP on loopback.

Two ways, same server underneath (real uvicorn, real sockets):

* ``run_server(app)`` — a context manager that serves ``app`` from a background thread with its own event loop.
  Use it from sync tests (the sync ``openai`` client) and whenever the test's loop must not share the server's::

      with run_server(app) as srv:
          client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=token)
          ...
          detail = srv.call(store.get_rollout(rollout_id))   # run a coroutine on the server's loop

  ``srv.call`` matters for in-memory objects the app owns (a ``MemoryStore``): touch them only from the loop
  that serves the app.

* ``async with serve_async(app) as srv:`` — serves ``app`` as a task on the *current* event loop (async tests with
  ``AsyncOpenAI``); the app's objects can then be awaited directly.

Both bind the socket before starting uvicorn (port 0 → the kernel picks a free port, no race), wait until the
server is ready (lifespan startup done), and shut down cleanly on exit, cancelling long-lived connections after
``graceful_s`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

import uvicorn

from tests.support.waiting import until_async

__all__ = ["RunningServer", "free_port", "run_server", "serve_async"]

T = TypeVar("T")


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for subprocesses that must be given a port number up front)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _bound_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def _config(app: Any, host: str, port: int, graceful_s: int, **uvicorn_kwargs: Any) -> uvicorn.Config:
    kwargs: dict[str, Any] = {"log_level": "warning", "lifespan": "auto", "timeout_graceful_shutdown": graceful_s}
    kwargs.update(uvicorn_kwargs)
    return uvicorn.Config(app, host=host, port=port, **kwargs)


class RunningServer:
    """A uvicorn server serving an app on loopback. ``url`` is ``http://127.0.0.1:<port>`` (no trailing slash)."""

    def __init__(self, server: uvicorn.Server, host: str, port: int) -> None:
        self.server = server
        self.host = host
        self.port = port
        self.url = f"http://{host}:{port}"
        self.loop: asyncio.AbstractEventLoop | None = None

    def settled(self) -> bool:
        """No connection is open and no request is being served (every handler has returned)."""
        state = self.server.server_state
        return not state.connections and not state.tasks

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run ``coro`` on the server's event loop and return its result (only for ``run_server``)."""
        if self.loop is None:
            coro.close()
            raise RuntimeError("call() needs a server started by run_server (a background thread)")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@contextlib.contextmanager
def run_server(
    app: Any, *, host: str = "127.0.0.1", port: int = 0, graceful_s: int = 2, **uvicorn_kwargs: Any
) -> Iterator[RunningServer]:
    """Serve ``app`` from a background thread; yields a ``RunningServer`` once it accepts connections."""
    sock = _bound_socket(host, port)
    real_port = int(sock.getsockname()[1])
    server = uvicorn.Server(_config(app, host, real_port, graceful_s, **uvicorn_kwargs))
    running = RunningServer(server, host, real_port)
    failure: list[BaseException] = []

    def target() -> None:
        loop = asyncio.new_event_loop()
        running.loop = loop
        try:
            loop.run_until_complete(server.serve(sockets=[sock]))
        except BaseException as exc:  # surfaced to the test thread below
            failure.append(exc)
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    thread = threading.Thread(target=target, name=f"uvicorn-{real_port}", daemon=True)
    thread.start()
    try:
        while not server.started:
            if failure or not thread.is_alive():
                raise RuntimeError(f"server on port {real_port} failed to start: {failure[:1]!r}")
            thread.join(0.01)
        yield running
    finally:
        server.should_exit = True
        thread.join(graceful_s + 10)
        sock.close()
        if thread.is_alive():
            server.force_exit = True
            thread.join(5)


@contextlib.asynccontextmanager
async def serve_async(
    app: Any, *, host: str = "127.0.0.1", port: int = 0, graceful_s: int = 2, **uvicorn_kwargs: Any
) -> AsyncIterator[RunningServer]:
    """Serve ``app`` as a task on the running event loop; yields a ``RunningServer`` once it is ready."""
    sock = _bound_socket(host, port)
    real_port = int(sock.getsockname()[1])
    server = uvicorn.Server(_config(app, host, real_port, graceful_s, **uvicorn_kwargs))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:

        def started() -> bool:
            if task.done():
                task.result()  # raises the startup error
                raise RuntimeError(f"server on port {real_port} exited during startup")
            return bool(server.started)

        await until_async(started, timeout=60, what=f"the server on port {real_port} to start")
        yield RunningServer(server, host, real_port)
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(task, graceful_s + 10)
        except (TimeoutError, asyncio.CancelledError):
            task.cancel()
        sock.close()
