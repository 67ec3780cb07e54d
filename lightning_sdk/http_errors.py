"""The one error table and the one bearer parser of every HTTP route (proxy, admin, store, daemon).

Every error answer has the OpenAI shape::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

``ERROR_TABLE`` maps the library's exceptions to (status, type, code), first match wins (subclasses first); the
proxy (``lightning_sdk.proxy._errors``) and the store's HTTP server and client (``lightning_sdk.store._wire``) all
read it, so the same exception is the same answer on every route, and a client maps the ``code`` back to the same
exception. ``UpstreamError`` keeps its own status (502 bad answer, 503 not reachable yet, 504 timeout).

401 and 409 answers carry ``x-should-retry: false``: the OpenAI SDK retries 409 by default, and a call after
``finish`` sent three times helps nobody. ``bearer_token`` is the one parser of ``Authorization: Bearer <token>``
(case-insensitive scheme, surrounding whitespace ignored), used by attempt-token and admin-key checks alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson

from lightning_sdk.errors import (
    AttemptNotRunningError,
    AuthError,
    ConfigError,
    InvalidTransitionError,
    LightningSDKError,
    NotFoundError,
    StoreError,
    StoreUnavailableError,
    UpstreamError,
)

__all__ = [
    "ERROR_TABLE",
    "ERROR_TYPES",
    "NO_RETRY_STATUSES",
    "bearer_token",
    "error_body",
    "error_fields",
    "error_headers",
    "exception_for",
]

ERROR_TABLE: list[tuple[type[LightningSDKError], int | None, str, str]] = [
    # (exception class, HTTP status (None: the exception's own), OpenAI error type, code)
    (AttemptNotRunningError, 409, "conflict_error", "attempt_not_running"),
    (NotFoundError, 404, "not_found_error", "not_found"),
    (InvalidTransitionError, 409, "conflict_error", "invalid_transition"),
    (StoreUnavailableError, 503, "service_unavailable_error", "store_unavailable"),
    (ConfigError, 400, "invalid_request_error", "invalid_argument"),
    (AuthError, 401, "authentication_error", "invalid_api_key"),
    (UpstreamError, None, "upstream_error", "upstream_error"),
    (StoreError, 500, "server_error", "store_error"),
]
"""The exception → (status, type, code) table of every route (first match wins)."""

ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "request_too_large",
    500: "server_error",
    502: "upstream_error",
    503: "service_unavailable_error",
    504: "upstream_timeout",
}
"""The OpenAI error ``type`` of an answer by status (for errors raised as a status, not an exception)."""

NO_RETRY_STATUSES = frozenset({401, 409})
"""Answers a client must not retry: they carry ``x-should-retry: false``."""


def error_fields(exc: LightningSDKError) -> tuple[int, str, str]:
    """(status, type, code) of ``exc`` from ``ERROR_TABLE`` (500 ``server_error`` when none matches)."""
    for cls, status, kind, code in ERROR_TABLE:
        if isinstance(exc, cls):
            if status is None:
                status = int(getattr(exc, "status_code", 502))
                kind = ERROR_TYPES.get(status, kind)
            return status, kind, code
    return 500, "server_error", "internal_error"


def exception_for(status: int, code: str | None, message: str) -> LightningSDKError:
    """The exception a client raises for an error answer (by ``code`` when it is in the table, else by status)."""
    for cls, cls_status, _, cls_code in ERROR_TABLE:
        if code == cls_code or (code is None and status == cls_status):
            if cls is UpstreamError:
                return UpstreamError(message, status_code=status)
            return cls(message)
    if 400 <= status < 500:
        return ConfigError(f"refused (HTTP {status}): {message}")
    return StoreError(f"failed (HTTP {status}): {message}")


def error_body(message: str, kind: str, *, param: str | None = None, code: str | None = None) -> bytes:
    """The OpenAI-shaped error body as JSON bytes."""
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})


def error_headers(status: int) -> list[tuple[bytes, bytes]]:
    """Headers every error answer of ``status`` carries besides its content type."""
    headers: list[tuple[bytes, bytes]] = []
    if status in NO_RETRY_STATUSES:
        headers.append((b"x-should-retry", b"false"))
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    return headers


def bearer_token(headers: Iterable[tuple[bytes, bytes]] | Any) -> str | None:
    """The token of ``Authorization: Bearer <token>`` (scheme case-insensitive), else ``None``.

    ``headers`` is an ASGI header list (``scope["headers"]``) or anything with ``.get("authorization")``
    (starlette's ``Headers``).
    """
    value: str | None
    if hasattr(headers, "get"):
        value = headers.get("authorization")
    else:
        value = None
        for name, raw in headers:
            if name == b"authorization":
                value = raw.decode("latin-1")
                break
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None
