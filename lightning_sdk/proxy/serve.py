"""Serve an ASGI app with uvicorn, the fast way when available (uvloop event loop, httptools HTTP parser)."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from typing import Any

import uvicorn

__all__ = ["header_timeout_protocol", "serve", "uvicorn_config"]

logger = logging.getLogger(__name__)


def header_timeout_protocol(timeout_s: float) -> type[Any]:
    """uvicorn's httptools protocol with a read timeout for incomplete requests.

    uvicorn waits forever for a request that never completes (a client that opens a connection, or starts a
    request, and then says nothing). This protocol answers 408 and closes the connection when an incomplete
    request (headers or body) has been silent for ``timeout_s``: the timer runs from the connection's opening or the
    request's first byte, restarts on every byte received, and stops once the request is complete. It costs a timer
    per read, not per ASGI ``receive``; the app keeps its own check between body chunks
    (``ProxyConfig.read_timeout_s``) for servers that do not use this protocol.
    """
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = asyncio.get_running_loop().call_later(timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            logger.debug("closing a connection whose request was incomplete and silent for %.1fs", timeout_s)
            cycle = getattr(self, "cycle", None)
            if cycle is not None and getattr(cycle, "response_started", False):  # answered already (e.g. 413)
                self.transport.close()
                return
            body = b'{"error":{"message":"incomplete request","type":"timeout_error","param":null,"code":null}}'
            head = b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            self.transport.write(head + b"content-length: %d\r\n\r\n" % len(body) + body)
            self.transport.close()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            self._arm()
            super().on_message_begin()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is not None:  # still reading a request: restart the silence timer
                self._disarm()
                self._arm()
            super().data_received(data)

        def on_message_complete(self) -> None:
            self._disarm()
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


def serve(app: Any, host: str = "127.0.0.1", port: int = 4700, **kwargs: Any) -> None:
    """Run ``app`` until interrupted (SIGINT/SIGTERM shut it down gracefully, flushing the recorder)."""
    config = uvicorn_config(app, host, port, **kwargs)
    http = config.http if isinstance(config.http, str) else "httptools"
    logger.info("serving on http://%s:%d (loop=%s, http=%s)", host, port, config.loop, http)
    try:
        uvicorn.Server(config).run()
    except KeyboardInterrupt:  # uvicorn re-raises SIGINT after its graceful shutdown: that is a normal exit
        logger.info("stopped")
