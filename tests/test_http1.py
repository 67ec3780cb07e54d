"""The proxy's HTTP/1.1 client against real sockets: keep-alive reuse, chunked replies, a server that closes idle
connections (transparent reconnect), connection refused, a silent server (read timeout), a reply cut off."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from lightning_sdk.http1 import Http1ConnectError, Http1Pool, Http1ProtocolError, Http1ReadTimeout
from tests.support.servers import free_port
from tests.support.waiting import until_async

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0
    )
    return head + await reader.readexactly(length)


class RawServer:
    """A tiny HTTP server whose behaviour each test scripts; counts connections."""

    def __init__(self, reply: Callable[[int], list[bytes]], *, close_after: bool = False, delay: float = 0.0):
        self.reply = reply
        self.close_after = close_after
        self.delay = delay
        self.connections = 0
        self.closed = 0  # connections this server has closed
        self.requests = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    await _read_request(reader)
                except asyncio.IncompleteReadError:
                    return
                self.requests += 1
                await asyncio.sleep(self.delay)
                for part in self.reply(self.requests):
                    writer.write(part)
                    await writer.drain()
                if self.close_after:
                    return
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            self.closed += 1


async def _serve(server: RawServer) -> AsyncIterator[str]:
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        srv.close()


def _ok(body: bytes) -> list[bytes]:
    return [b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body]


async def test_keep_alive_and_chunked() -> None:
    def chunked(n: int) -> list[bytes]:
        return [
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"5\r\nhello\r\n",
            b"6\r\n world\r\n0\r\n\r\n",
        ]

    server = RawServer(chunked)
    async for url in _serve(server):
        pool = Http1Pool(url)
        for _ in range(5):
            assert await pool.request("POST", "/x", b"{}", {}) == (200, b"hello world")
        assert server.connections == 1 and server.requests == 5
        resp = await pool.send("POST", "/x", b"{}", {})
        assert [c async for c in resp.iter_bytes()] and resp.status == 200
        await pool.aclose()


async def test_reconnects_when_the_server_closed_the_idle_connection() -> None:
    server = RawServer(lambda n: _ok(b'{"n": %d}' % n), close_after=True)
    async for url in _serve(server):
        pool = Http1Pool(url)
        assert await pool.request("GET", "/models", b"", {}) == (200, b'{"n": 1}')
        await until_async(lambda: server.closed == 1, timeout=10, what="the server to close the connection")
        assert await pool.request("GET", "/models", b"", {}) == (200, b'{"n": 2}')
        assert server.connections == 2
        await pool.aclose()


async def test_connect_error_timeout_and_cut_off_reply() -> None:
    with pytest.raises(Http1ConnectError):
        await Http1Pool(f"http://127.0.0.1:{free_port()}").request("GET", "/", b"", {})

    silent = RawServer(lambda n: _ok(b"late"), delay=2.0)
    async for url in _serve(silent):
        with pytest.raises(Http1ReadTimeout):
            await Http1Pool(url, read_timeout=0.2).request("GET", "/", b"", {})

    cut = RawServer(lambda n: [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part"], close_after=True)
    async for url in _serve(cut):
        with pytest.raises(Http1ProtocolError, match="mid-reply"):
            await Http1Pool(url).request("GET", "/", b"", {})
