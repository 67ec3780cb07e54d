"""Serve an ASGI app with uvicorn, the fast way when available (uvloop event loop, httptools HTTP parser)."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import logging
import re
from typing import Any

import uvicorn

__all__ = [
    "GC_GEN0_THRESHOLD",
    "MAX_HEAD_BYTES",
    "header_timeout_protocol",
    "serve",
    "tune_gc_for_serving",
    "uvicorn_config",
]

logger = logging.getLogger(__name__)


class _CorkedWrites:
    """The transport a response cycle writes to: its first write (uvicorn writes the status line and headers on
    their own) is held and goes out together with the next one (the body) in one ``writelines``: one send per
    response instead of two (a loopback send costs the sender the receiver's TCP work too). What is held is
    written at the latest at the end of the loop iteration (a streamed response whose first chunk takes long still
    gets its headers at once), and before anything else reaches the socket.
    """

    __slots__ = ("_held", "_loop", "_transport", "armed")

    def __init__(self, transport: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self.armed = False  # hold the next write (set when a request's cycle starts)

    def write(self, data: bytes) -> None:
        if self.armed:
            self.armed = False
            self.flush()
            self._held = data
            self._loop.call_soon(self.flush)
            return
        held = self._held
        if held is None:
            self._transport.write(data)
        else:
            self._held = None
            self._transport.writelines((held, data))

    def flush(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if not self._transport.is_closing():
                self._transport.write(held)

    def is_closing(self) -> bool:
        return bool(self._transport.is_closing())

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


MAX_HEAD_BYTES = 64 * 1024
"""The most a request's line and headers may take (431, then close). uvicorn with httptools has no such limit: a
client could stream headers for ever and the server kept taking them (20 MB of headers were accepted in a test)."""


def _error_reply(status: str, message: str, kind: str) -> bytes:
    """A complete HTTP/1.1 error reply that closes the connection, in the OpenAI error shape."""
    body = b'{"error":{"message":"%s","type":"%s","param":null,"code":null}}' % (message.encode(), kind.encode())
    head = b"HTTP/1.1 %s\r\ncontent-type: application/json\r\nconnection: close\r\n" % status.encode()
    return head + b"content-length: %d\r\n\r\n" % len(body) + body


_REQUEST_LINE = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+ [^ ]+ HTTP/[0-9]\.[0-9]")
"""An HTTP/1.x request line: method, target, version (RFC 9112 section 3)."""

_NO_VERSION = _error_reply(
    "400 Bad Request",
    "invalid HTTP request line: expected METHOD TARGET HTTP/1.1",
    "invalid_request_error",
)
_TIMED_OUT = _error_reply("408 Request Timeout", "incomplete request", "timeout_error")
_HEAD_TOO_LARGE = _error_reply(
    "431 Request Header Fields Too Large",
    f"the request line and headers are over {MAX_HEAD_BYTES} bytes",
    "invalid_request_error",
)


def header_timeout_protocol(timeout_s: float) -> type[Any]:
    """uvicorn's httptools protocol with a read timeout for incomplete requests, and one write per response.

    uvicorn waits forever for a request that never completes (a client that opens a connection, or starts a
    request, and then says nothing). This protocol answers 408 and closes the connection when an incomplete
    request (headers or body) has been silent for ``timeout_s``: the silence counts from the connection's opening
    or the request's last byte received, while the request is incomplete. One timer per connection looks at it
    every ``timeout_s`` at most (no timer armed and cancelled per request or per read); the app keeps its own check
    between body chunks (``ProxyConfig.read_timeout_s``) for servers that do not use this protocol. Each request's
    response goes out with its headers and (first) body in one write (``_CorkedWrites``).

    A request whose line and headers go over ``MAX_HEAD_BYTES`` gets 431 and the connection is closed; a request
    that cannot be parsed gets uvicorn's 400, in the OpenAI error shape like every other refusal of the proxy. A
    request line without an HTTP version (``GET /path``, HTTP/0.9 style), or an empty line as a connection's first
    bytes, gets 400 and the close as soon as the line is complete (the parser would wait for more until the read
    timeout); one empty line after a request is ignored, as RFC 9112 asks (some clients send a CRLF after a body).
    """
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None
        _corked: _CorkedWrites | None = None
        _reading = True  # between the connection's opening or a request's first byte and the request's end
        _last_byte = 0.0  # loop time of the last bytes received
        _in_head = False  # between a request's first byte and the end of its headers
        _head_bytes = 0  # bytes received while in the head (counted per received chunk, after parsing it)
        _awaiting_line = True  # the next bytes start a request line (checked here before the parser sees them)
        _line = b""  # what arrived of that line so far
        _unchecked = False  # the parser got bytes after a request's end that this check has not seen
        _served = 0  # requests completed on this connection

        def _tick(self) -> None:
            """One timer per connection, run every ``timeout_s`` at most (not armed and cancelled per request):
            408 for a request silent that long, otherwise look again when it could be."""
            self._header_timer = None
            if self.transport.is_closing():
                return
            delay = timeout_s
            if self._reading:
                silent = self.loop.time() - self._last_byte
                if silent >= timeout_s:
                    self._headers_too_slow()
                    return
                delay = timeout_s - silent
            self._header_timer = self.loop.call_later(delay, self._tick)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            logger.debug("closing a connection whose request was incomplete and silent for %.1fs", timeout_s)
            cycle = getattr(self, "cycle", None)
            if cycle is not None and getattr(cycle, "response_started", False):  # answered already (e.g. 413)
                self.transport.close()
                return
            if self._corked is not None:
                self._corked.flush()
            self.transport.write(_TIMED_OUT)
            self.transport.close()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._corked = _CorkedWrites(transport, self.loop)
            self._last_byte = self.loop.time()
            self._header_timer = self.loop.call_later(timeout_s, self._tick)

        def _check_request_line(self, data: bytes) -> bool:
            """Whether the request line starting here is one the parser can finish (else: 400 sent, closing)."""
            line = self._line + data
            if self._served and line.startswith((b"\r\n", b"\n")):  # one empty line after a request: ignored
                line = line[2:] if line.startswith(b"\r\n") else line[1:]
            end = line.find(b"\n")
            if end < 0:
                self._line = line[:MAX_HEAD_BYTES]
                return True
            self._awaiting_line, self._line = False, b""
            if _REQUEST_LINE.fullmatch(line[:end].rstrip(b"\r")):
                return True
            logger.debug("refusing a request line without an HTTP version: %r", line[:80])
            if self._corked is not None:
                self._corked.flush()
            self.transport.write(_NO_VERSION)
            self.transport.close()
            return False

        def on_message_begin(self) -> None:
            if self._unchecked:  # a pipelined request began in bytes the line check did not see: the parser's
                self._awaiting_line, self._line = False, b""
            self._reading = True
            self._in_head = True
            self._head_bytes = 0
            super().on_message_begin()

        def data_received(self, data: bytes) -> None:
            self._last_byte = self.loop.time()
            self._unchecked = False
            if self._awaiting_line and not self._check_request_line(data):
                return
            super().data_received(data)
            self._unchecked = False
            if self._in_head:  # this chunk ended inside a request's head: count it (a chunk is at most 256 KB)
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                    logger.debug("refusing a request whose head is over %d bytes", MAX_HEAD_BYTES)
                    cycle = self.cycle
                    if cycle is None or cycle.response_complete:  # not in the middle of another answer
                        if self._corked is not None:
                            self._corked.flush()
                        self.transport.write(_HEAD_TOO_LARGE)
                    self.transport.close()

        def send_400_response(self, msg: str) -> None:
            if self._corked is not None:
                self._corked.flush()
            self.transport.write(_error_reply("400 Bad Request", "invalid HTTP request", "invalid_request_error"))
            self.transport.close()

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()
            cycle = self.cycle
            if cycle is not None and cycle.transport is self.transport and self._corked is not None:
                self._corked.armed = True
                cycle.transport = self._corked  # type: ignore[assignment]  # a Transport in all it uses

        def on_message_complete(self) -> None:
            self._reading = False
            self._served += 1
            self._awaiting_line, self._line, self._unchecked = True, b"", True
            super().on_message_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol


def uvicorn_config(app: Any, host: str = "127.0.0.1", port: int = 4700, **kwargs: Any) -> uvicorn.Config:
    """A uvicorn config for the proxy: uvloop + httptools when installed, no access log, keep-alive for agents,
    and (with httptools) a read timeout for incomplete requests (the proxy app's ``read_timeout_s``, default 30 s)."""
    has_httptools = importlib.util.find_spec("httptools") is not None
    proxy_config = getattr(getattr(app, "proxy", None), "config", None)
    header_timeout = float(getattr(proxy_config, "read_timeout_s", 30.0))
    options: dict[str, Any] = {
        "loop": "uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        "http": header_timeout_protocol(header_timeout) if has_httptools else "h11",
        "access_log": False,
        "log_level": "warning",
        "timeout_keep_alive": 75,
        "backlog": 4096,
        "lifespan": "on",
        "proxy_headers": False,
        "server_header": False,
    }
    options.update(kwargs)
    return uvicorn.Config(app, host=host, port=port, **options)


GC_GEN0_THRESHOLD = 50_000
"""The young-generation threshold ``serve`` sets (CPython's default: 700 net allocations of tracked objects)."""


def tune_gc_for_serving(gen0: int = GC_GEN0_THRESHOLD) -> None:
    """Set the cyclic garbage collector up for a process that only serves: collect what start-up left, freeze every
    object alive now (imports, the app, its store: ``gc.freeze``, so full collections no longer walk them) and run
    the young collection every ``gen0`` net allocations instead of 700 (older generations keep their ratios).

    Why: at any moment the calls in flight, the records waiting in the recorder's queue (up to 50 ms of calls) and,
    in token mode, the running attempts' kept calls hold thousands of tracked objects, so with the default a young
    collection ran every ~50 calls and kept traversing and promoting them: 13-18 us of CPU per call in collections
    at concurrency 32 (measured with ``gc.callbacks``, proxy app driven in-process), 4.9-5.2 us with 7,000 and
    2.0-3.2 us with 50,000 (``benchmarks/proxy_inprocess.py``, alternated). The threshold counts objects that stay
    alive, and the proxy leaves little cyclic garbage (about 0.2 unreachable objects a call: 2,576 after 12,000
    calls with automatic collection off), so what waits for a collection stays small; a young collection walks at
    most ``gen0`` objects (a few milliseconds, rarely). Reference counting frees everything else as before.
    Process-wide, so only ``serve`` (a process of its own) calls it, not an app embedded elsewhere.
    """
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0, gen1, gen2)


def serve(app: Any, host: str = "127.0.0.1", port: int = 4700, *, tune_gc: bool = True, **kwargs: Any) -> None:
    """Run ``app`` until interrupted (SIGINT/SIGTERM shut it down gracefully, flushing the recorder).

    ``tune_gc``: this process only serves ``app``: see ``tune_gc_for_serving``.
    """
    if tune_gc:
        tune_gc_for_serving()
    config = uvicorn_config(app, host, port, **kwargs)
    http = config.http if isinstance(config.http, str) else "httptools"
    logger.info("serving on http://%s:%d (loop=%s, http=%s)", host, port, config.loop, http)
    try:
        uvicorn.Server(config).run()
    except KeyboardInterrupt:  # uvicorn re-raises SIGINT after its graceful shutdown: that is a normal exit
        logger.info("stopped")
