"""A request line without an HTTP version (HTTP/0.9 style) or an empty line as a connection's first bytes gets 400
and the close at once (not the read timeout's 408 thirty seconds later); a request line split over packets, and one
empty line after a request (RFC 9112 lets servers ignore it), still work. Raw sockets against the real proxy on
loopback, served with the protocol ``lightning-sdk proxy`` uses (``serve.header_timeout_protocol``)."""

from __future__ import annotations

import socket
import time

import pytest

from tests.support.proxy import ProxyHandle

_HEALTH = b"GET /lightning/v1/health HTTP/1.1\r\nHost: x\r\n\r\n"


def _connect(px: ProxyHandle) -> socket.socket:
    sock = socket.create_connection((px.server.host, px.server.port), timeout=10)
    sock.settimeout(10)  # bounds a failure only: the answer is expected at once
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def _read_response(sock: socket.socket) -> bytes:
    """One response (its headers and a body of ``content-length`` bytes) on a kept-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


@pytest.mark.parametrize(
    "parts",
    [[b"GET /lightning/v1/health\r\n"], [b"GET /lightning/v1/hea", b"lth\r\n"], [b"\r\n"], [b"hello there\n"]],
    ids=["no version", "no version, split", "blank line first", "not a request line"],
)
def test_a_line_the_parser_cannot_finish_is_refused_at_once(px: ProxyHandle, parts: list[bytes]) -> None:
    with _connect(px) as sock:
        t0 = time.monotonic()
        for part in parts:
            sock.sendall(part)
        answer = _read_all(sock)
        waited = time.monotonic() - t0
    assert answer.startswith(b"HTTP/1.1 400 Bad Request") and b"connection: close" in answer
    assert b'"type":"invalid_request_error"' in answer
    assert waited < 5.0  # not the 30 s read timeout


def test_split_request_lines_and_a_crlf_after_a_request_still_work(px: ProxyHandle) -> None:
    with _connect(px) as sock:
        sock.sendall(_HEALTH[:12])
        sock.sendall(_HEALTH[12:])
        assert _read_response(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(b"\r\n" + _HEALTH)  # an old client's CRLF after the previous request, then the next one
        assert _read_response(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(_HEALTH + _HEALTH)  # pipelined
        assert _read_response(sock).startswith(b"HTTP/1.1 200")
        assert _read_response(sock).startswith(b"HTTP/1.1 200")
