"""Listening sockets, bound before the slow set-up: a neutral module (sockets only; no server, no client).

``bind_socket`` is called first by every job and proxy actor, so a bad or busy port is a one-line ``ConfigError``
before minutes of policy loading, not a uvicorn traceback after them; ``free_port`` picks a port for tests and
launched servers.
"""

from __future__ import annotations

import socket

from lightning_sdk.errors import ConfigError

__all__ = ["bind_socket", "free_port", "socket_url"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def bind_socket(host: str, port: int, *, backlog: int | None = None, who: str = "") -> socket.socket:
    """Bind a listening socket now (``port`` 0: a free one), before the slow policy set-up, so a bad or busy port
    is a one-line ``ConfigError`` (``who`` names the server in it) instead of a uvicorn traceback minutes later.
    ``backlog``: listen at once, so connections wait until the server serves instead of being refused."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"port {port} is not a TCP port (0-65535)")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        if backlog is not None:
            sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"{who + ' ' if who else ''}cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def socket_url(sock: socket.socket, host: str) -> str:
    """The ``http://host:port`` a server on ``sock`` answers at (known before it serves)."""
    return f"http://{host}:{int(sock.getsockname()[1])}"
