"""HTTP errors in the OpenAI shape, and request validation that names the offending field.

Every error the proxy answers looks like OpenAI's::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "messages[2].role", "code": null}}

``ProxyHTTPError`` is raised inside handlers; ``error_response`` renders it, and ``from_sdk_error`` translates the
library's exceptions (``AuthError`` → 401, ``AttemptNotRunningError`` → 409, ``UpstreamError`` → 502/504, ...).
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

from lightning_sdk.errors import (
    AttemptNotRunningError,
    AuthError,
    ConfigError,
    InvalidTransitionError,
    LightningSDKError,
    NotFoundError,
    StoreUnavailableError,
    UpstreamError,
)

__all__ = [
    "ProxyHTTPError",
    "error_response",
    "from_sdk_error",
    "validate_chat",
    "validate_completions",
]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_timeout",
}


class ProxyHTTPError(Exception):
    """An HTTP error answer; ``param`` names the request field at fault (400)."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None, kind: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_response(err: ProxyHTTPError, payload: dict[str, Any] | None = None) -> Response:
    body = payload or {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}}
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return Response(orjson.dumps(body), status_code=err.status, media_type="application/json", headers=headers)


def from_sdk_error(exc: LightningSDKError) -> ProxyHTTPError:
    """The HTTP error for one of the library's exceptions."""
    if isinstance(exc, AuthError):
        return ProxyHTTPError(401, str(exc), code="invalid_api_key")
    if isinstance(exc, AttemptNotRunningError):
        return ProxyHTTPError(409, str(exc), code="attempt_not_running")
    if isinstance(exc, UpstreamError):
        return ProxyHTTPError(exc.status_code, str(exc))
    if isinstance(exc, NotFoundError):
        return ProxyHTTPError(404, str(exc))
    if isinstance(exc, InvalidTransitionError):
        return ProxyHTTPError(409, str(exc), code="invalid_transition")
    if isinstance(exc, StoreUnavailableError):
        return ProxyHTTPError(503, str(exc))
    if isinstance(exc, ConfigError):
        return ProxyHTTPError(400, str(exc))
    return ProxyHTTPError(500, f"{type(exc).__name__}: {exc}", kind="server_error")


# -- validation ------------------------------------------------------------------------------------------------------
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def _bad(param: str, message: str) -> ProxyHTTPError:
    return ProxyHTTPError(400, f"{param}: {message}", param=param)


def _check_common(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise _bad("body", "the request body must be a JSON object")
    body: dict[str, Any] = raw
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "required, a non-empty string")
    if "stream" in body and not isinstance(body["stream"], bool | None):
        raise _bad("stream", "must be a boolean")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise _bad("stream_options", "must be an object")
    for key in ("max_tokens", "max_completion_tokens", "n"):
        value = body.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise _bad(key, "must be a positive integer")
    for key in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        value = body.get(key)
        if value is not None and (not isinstance(value, int | float) or isinstance(value, bool)):
            raise _bad(key, "must be a number")
    return body


def validate_chat(raw: Any) -> dict[str, Any]:
    """Check the fields the proxy relies on; raise a 400 naming the first bad field."""
    body = _check_common(raw)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "required, a non-empty list of message objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", "must be an object")
        role = m.get("role")
        if role not in _ROLES:
            raise _bad(f"messages[{i}].role", f"must be one of {', '.join(sorted(_ROLES))}")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise _bad(f"messages[{i}].content", "must be a string, a list of content parts or null")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("tools", "must be a list")
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise _bad(f"tools[{i}].function.name", "required, a string")
    if "logprobs" in body and not isinstance(body["logprobs"], bool | None):
        raise _bad("logprobs", "must be a boolean")
    return body


def validate_completions(raw: Any) -> dict[str, Any]:
    """Check a ``/v1/completions`` request; raise a 400 naming the first bad field."""
    body = _check_common(raw)
    prompt = body.get("prompt")
    ok = isinstance(prompt, str) or (
        isinstance(prompt, list)
        and bool(prompt)
        and (
            all(isinstance(p, str) for p in prompt)
            or all(isinstance(p, int) and not isinstance(p, bool) for p in prompt)
            or all(isinstance(p, list) and all(isinstance(x, int) for x in p) for p in prompt)
        )
    )
    if not ok:
        raise _bad("prompt", "required: a string, a list of strings, a list of token ids or a list of id lists")
    return body
