"""Serve an ASGI app with uvicorn, the fast way when available (uvloop event loop, httptools HTTP parser)."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import uvicorn

__all__ = ["serve", "uvicorn_config"]

logger = logging.getLogger(__name__)


def uvicorn_config(app: Any, host: str = "127.0.0.1", port: int = 4700, **kwargs: Any) -> uvicorn.Config:
    """A uvicorn config for the proxy: uvloop + httptools when installed, no access log, keep-alive for agents."""
    options: dict[str, Any] = {
        "loop": "uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        "http": "httptools" if importlib.util.find_spec("httptools") else "h11",
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
    logger.info("serving on http://%s:%d (loop=%s, http=%s)", host, port, config.loop, config.http)
    try:
        uvicorn.Server(config).run()
    except KeyboardInterrupt:  # uvicorn re-raises SIGINT after its graceful shutdown: that is a normal exit
        logger.info("stopped")
