"""A small pooled HTTP/1.1 client (asyncio protocol + httptools): the proxy's upstream and the agents' transport.

A neutral module: both the agent side and the proxy import it, and it imports no server (no starlette, no uvicorn).

Why not httpx or aiohttp: forwarding a request is the proxy's whole job, and on a small machine the general clients
cost more CPU per request than everything else the proxy does (measured here: aiohttp ~0.1 ms, httpx ~0.3 ms,
this client ~0.03 ms per request). It does exactly what forwarding to an OpenAI-compatible server needs: keep-alive
connections to one origin, a request with a body, the reply read whole (``request``) or as it arrives (``stream``),
content-length and chunked replies, a connect timeout and a read timeout (longest silence). Errors are raised as
``Http1ConnectError`` (nothing was sent: safe to retry), ``Http1ReadTimeout`` and ``Http1ProtocolError``.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httptools

from lightning_sdk.errors import UpstreamError

__all__ = [
    "Http1ConnectError",
    "Http1Error",
    "Http1Pool",
    "Http1ProtocolError",
    "Http1ReadTimeout",
    "Http1Response",
]


class Http1Error(UpstreamError):
    """Any failure of the upstream connection (an ``UpstreamError``: 502 unless translated first)."""


class Http1ConnectError(Http1Error):
    """Could not connect (or the pooled connection was dead before anything was read): safe to retry."""


class Http1ReadTimeout(Http1Error):
    """The server was silent for longer than the read timeout (504)."""

    def __init__(self, message: str, *, status_code: int = 504) -> None:
        super().__init__(message, status_code=status_code)


class Http1ProtocolError(Http1Error):
    """The connection broke or the server sent something that is not HTTP/1.1 (mid-reply: not safe to retry)."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection; serves one request at a time."""

    def __init__(self, pool: Http1Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: collections.deque[bytes] = collections.deque()
        self.complete = False
        self.error: Http1Error | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.got_bytes = False
        self.last_read = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.paused = False

    # -- asyncio.Protocol ------------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self.last_read = time.monotonic()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(Http1ProtocolError(f"invalid HTTP reply: {exc}"))
            return
        if not self.paused and len(self.chunks) > 64 and self.transport is not None:
            self.transport.pause_reading()
            self.paused = True
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        if not self.complete:
            if self.got_bytes:
                self._fail(Http1ProtocolError(f"connection closed mid-reply ({exc or 'EOF'})"))
            else:
                self._fail(Http1ConnectError(f"connection closed before the reply ({exc or 'EOF'})"))

    # -- httptools callbacks ---------------------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        self.complete = True
        if not self.parser.should_keep_alive():
            self.closed = True
        self._wake()

    # -- internals -------------------------------------------------------------------------------------------------
    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _fail(self, error: Http1Error) -> None:
        if self.error is None:
            self.error = error
        self.closed = True
        if self.transport is not None:
            self.transport.close()
        self._wake()

    def _check_timeout(self) -> None:
        """The read-timeout timer: fail a request whose reply has been silent for ``read_timeout``, or run again
        when it could be. One timer per connection, kept across its requests (not a timer per request)."""
        self.timer = None
        if self.waiter is None or self.waiter.done() or self.closed:
            return
        idle = time.monotonic() - self.last_read
        if idle >= self.pool.read_timeout:
            self._fail(Http1ReadTimeout(f"no reply bytes for {self.pool.read_timeout}s"))
        else:
            self.timer = self.pool.loop.call_later(self.pool.read_timeout - idle, self._check_timeout)

    async def wait(self) -> None:
        """Wait for the next event (headers, body bytes, end, error)."""
        if self.error is not None:
            raise self.error
        self.waiter = self.pool.loop.create_future()
        if self.timer is None:
            self.timer = self.pool.loop.call_later(self.pool.read_timeout, self._check_timeout)
        try:
            await self.waiter
        finally:
            self.waiter = None
        if self.error is not None:
            raise self.error

    def start(self, request: bytes) -> None:
        self.status = 0
        self.headers = []
        self.chunks.clear()
        self.complete = False
        self.got_bytes = False
        self.last_read = time.monotonic()
        self.parser = httptools.HttpResponseParser(self)
        assert self.transport is not None
        self.transport.write(request)

    def take(self) -> bytes:
        data = b"".join(self.chunks)
        self.chunks.clear()
        if self.paused and self.transport is not None:
            self.transport.resume_reading()
            self.paused = False
        return data

    def done(self) -> None:
        """The request is over. The read-timeout timer of a kept-alive connection runs on (it checks whether a
        request is waiting when it fires); a closed connection's is cancelled."""
        if self.closed:
            self._cancel_timer()

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class Http1Response:
    """A reply being read: ``status`` and ``headers`` are known; read the body with ``read()`` or ``iter_bytes()``."""

    def __init__(self, pool: Http1Pool, conn: _Conn) -> None:
        self._pool = pool
        self._conn: _Conn | None = conn
        self.status = conn.status
        self.headers = conn.headers

    async def read(self) -> bytes:
        conn = self._conn
        if conn is not None and conn.complete:  # the whole reply came with its headers (the common case)
            data = conn.take()
            self.release()
            return data
        parts = []
        async for chunk in self.iter_bytes():
            parts.append(chunk)
        return b"".join(parts)

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        conn = self._conn
        if conn is None:
            return
        while True:
            if conn.chunks:
                yield conn.take()
            if conn.complete:
                if conn.chunks:
                    yield conn.take()
                self.release()
                return
            await conn.wait()

    def release(self) -> None:
        """Give the connection back (if the reply was read to the end) or close it."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        conn.done()
        if conn.complete and not conn.closed and conn.error is None:
            self._pool._idle.append(conn)
        elif conn.transport is not None:
            conn.transport.close()

    def close(self) -> None:
        """Drop the connection (the server sees the client go away and can stop working)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.closed = True
            conn.done()
            if conn.transport is not None:
                conn.transport.close()


class Http1Pool:
    """Keep-alive connections to one origin (``http://host:port`` or ``https://...``)."""

    def __init__(
        self, base_url: str, *, connect_timeout: float = 10.0, read_timeout: float = 600.0, max_idle: int = 256
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if parts.scheme == "https" else None
        default_port = (parts.scheme == "https" and self.port == 443) or (parts.scheme == "http" and self.port == 80)
        self.host_header = (self.host if default_port else f"{self.host}:{self.port}").encode()
        self.prefix = parts.path.rstrip("/")
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_idle = max_idle
        self._idle: collections.deque[_Conn] = collections.deque(maxlen=max_idle)
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    async def _connect(self) -> _Conn:
        try:
            transport, conn = await asyncio.wait_for(
                self.loop.create_connection(lambda: _Conn(self), self.host, self.port, ssl=self.ssl),
                self.connect_timeout,
            )
        except (OSError, TimeoutError) as exc:
            raise Http1ConnectError(f"cannot connect to {self.host}:{self.port}: {exc or type(exc).__name__}") from exc
        conn.transport = transport  # uvloop may call connection_made only after create_connection returns
        return conn

    def _encode(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        lines = [f"{method} {self.prefix}{path} HTTP/1.1".encode(), b"Host: " + self.host_header]
        lines.extend(f"{k}: {v}".encode() for k, v in headers.items())
        lines.append(b"Content-Length: " + str(len(body)).encode())
        return b"\r\n".join(lines) + b"\r\n\r\n" + body

    async def send(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> Http1Response:
        """Send a request and wait for the reply's status and headers; read the body from the response."""
        request = self._encode(method, path, body, headers)
        while True:
            reused = bool(self._idle)
            conn = self._idle.pop() if reused else await self._connect()
            if conn.closed:
                continue
            conn.start(request)
            try:
                while not conn.status:
                    await conn.wait()
            except Http1ConnectError:
                if reused:  # a kept-alive connection the server had closed: try a fresh one
                    continue
                raise
            except BaseException:
                conn.done()
                if conn.transport is not None:
                    conn.transport.close()
                raise
            return Http1Response(self, conn)

    async def request(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        """Send a request and read the whole reply: ``(status, body)``."""
        resp = await self.send(method, path, body, headers)
        try:
            return resp.status, await resp.read()
        finally:
            resp.close() if resp._conn is not None else None

    async def aclose(self) -> None:
        while self._idle:
            conn = self._idle.pop()
            if conn.transport is not None:
                conn.transport.close()

    def __repr__(self) -> str:
        return f"Http1Pool({self.host}:{self.port}{self.prefix}, idle={len(self._idle)})"
