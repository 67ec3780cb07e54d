"""HTTP errors in the OpenAI shape, and request validation that names the offending field.

Every error the proxy answers looks like OpenAI's::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "messages[2].role", "code": null}}

``ProxyHTTPError`` is raised inside handlers; ``error_response`` renders it (401/409 with ``x-should-retry:
false``), and ``from_sdk_error`` translates the library's exceptions through the one table of every route
(``lightning_sdk.http_errors.ERROR_TABLE``: ``AuthError`` → 401, ``AttemptNotRunningError`` → 409,
``UpstreamError`` → 502/503/504, ...).

The validators are plain functions the routes share (chat completions, completions, and the Responses/Anthropic
surfaces after they translate their request into a chat body): ``validate_chat`` / ``validate_completions`` check
types and ranges (temperature in [0, 2], top_p in (0, 1], a 64-bit seed, max_tokens >= 1, string roles, a
``tool_choice`` that names an offered tool, a known ``response_format``) and raise a 400 naming the parameter.
"""

from __future__ import annotations

import math
from typing import Any

import orjson
from starlette.responses import Response

from lightning_sdk.errors import LightningSDKError, UpstreamError
from lightning_sdk.http_errors import ERROR_TYPES, error_fields, error_headers

__all__ = [
    "ProxyHTTPError",
    "error_event",
    "error_response",
    "from_sdk_error",
    "tool_choice_of",
    "validate_chat",
    "validate_completions",
]

_INT64 = (-(2**63), 2**63 - 1)


class ProxyHTTPError(LightningSDKError):
    """An HTTP error answer; ``param`` names the request field at fault (400). Part of the one exception tree
    (``lightning_sdk.errors``), so ``from_sdk_error`` passes it through unchanged."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None, kind: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind or ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers: list[tuple[bytes, bytes]] = []  # extra answer headers (e.g. Retry-After)
        self.payload: dict[str, Any] | None = None  # an upstream's own error body, passed on as is

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def error_response(err: ProxyHTTPError, payload: dict[str, Any] | None = None) -> Response:
    """The starlette response of ``err`` (``payload``: an upstream's own error body, passed on as is)."""
    response = Response(orjson.dumps(payload or err.body()), status_code=err.status, media_type="application/json")
    response.raw_headers.extend(error_headers(err.status) + err.headers)
    return response


def error_event(err: ProxyHTTPError) -> bytes:
    """The server-sent event that ends a stream cut off by ``err`` (followed by ``data: [DONE]``)."""
    return b"data: " + orjson.dumps(err.body()) + b"\n\n"


def from_sdk_error(exc: LightningSDKError) -> ProxyHTTPError:
    """The HTTP error for one of the library's exceptions (the table of ``lightning_sdk.http_errors``)."""
    if isinstance(exc, ProxyHTTPError):  # already an answer: keep its status, param and headers
        return exc
    status, kind, code = error_fields(exc)
    message = str(exc) if status != 500 else f"{type(exc).__name__}: {exc}"
    err = ProxyHTTPError(status, message, code=code, kind=kind)
    retry_after = exc.retry_after_s if isinstance(exc, UpstreamError) else None
    if retry_after is not None:
        err.headers.append((b"retry-after", str(max(1, math.ceil(retry_after))).encode()))
    return err


# -- validation ------------------------------------------------------------------------------------------------------
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_TOOL_CHOICES = ("none", "auto", "required")
_RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def _bad(param: str, message: str) -> ProxyHTTPError:
    return ProxyHTTPError(400, f"{param}: {message}", param=param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


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
        if value is not None and (not _is_int(value) or value < 1):
            raise _bad(key, "must be a positive integer")
    for key, low, high, low_open in (
        ("temperature", 0.0, 2.0, False),
        ("top_p", 0.0, 1.0, True),
        ("presence_penalty", -2.0, 2.0, False),
        ("frequency_penalty", -2.0, 2.0, False),
    ):
        value = body.get(key)
        if value is None:
            continue
        if not _is_number(value):
            raise _bad(key, "must be a number")
        if value > high or value < low or (low_open and value == low):
            raise _bad(key, f"must be in {'(' if low_open else '['}{low:g}, {high:g}]")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not _INT64[0] <= seed <= _INT64[1]):
        raise _bad("seed", "must be an integer that fits in 64 bits")
    stop = body.get("stop")
    if (
        stop is not None
        and not isinstance(stop, str)
        and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise _bad("stop", "must be a string or a list of strings")
    bias = body.get("logit_bias")
    if bias is not None and not isinstance(bias, dict):
        raise _bad("logit_bias", "must be an object of token id -> bias")
    return body


def _check_response_format(body: dict[str, Any]) -> None:
    fmt = body.get("response_format")
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in _RESPONSE_FORMATS:
        raise _bad("response_format", f"must be an object with type one of {', '.join(_RESPONSE_FORMATS)}")
    if kind == "json_schema" and not isinstance(fmt.get("json_schema"), dict):
        raise _bad("response_format.json_schema", "required with type json_schema, an object")


def tool_choice_of(body: dict[str, Any]) -> str | None:
    """What a validated chat body's ``tool_choice`` asks: ``"none"``, ``"auto"``, ``"required"`` or a tool's name.

    ``None`` when no tools are offered (then the reply is never parsed for tool calls). OpenAI's default with tools
    is ``"auto"``.
    """
    if not body.get("tools"):
        return None
    choice = body.get("tool_choice")
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        return choice
    return str(choice["function"]["name"])


def _check_tools(body: dict[str, Any]) -> None:
    tools = body.get("tools")
    names: list[str] = []
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("tools", "must be a list")
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise _bad(f"tools[{i}].function.name", "required, a string")
            names.append(fn["name"])
    choice = body.get("tool_choice")
    if choice is None:
        return
    if isinstance(choice, str):
        if choice not in _TOOL_CHOICES:
            raise _bad("tool_choice", f"must be one of {', '.join(_TOOL_CHOICES)} or a named function")
        if choice == "required" and not names:
            raise _bad("tool_choice", "'required' needs at least one tool in tools")
        return
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise _bad("tool_choice", 'must be a string or {"type": "function", "function": {"name": ...}}')
    if name not in names:
        raise _bad("tool_choice", f"names function {name!r}, which is not in tools")


def _check_message_fields(m: dict[str, Any], where: str) -> None:
    """A message's ``name``, ``tool_call_id`` and ``tool_calls``: what rendering and the call's record read."""
    for key in ("name", "tool_call_id"):
        value = m.get(key)
        if value is not None and not isinstance(value, str):
            raise _bad(f"{where}.{key}", "must be a string or null")
    calls = m.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, list):
        raise _bad(f"{where}.tool_calls", "must be a list of tool calls or null")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"{where}.tool_calls[{j}].function.name", "required, a string")
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise _bad(f"{where}.tool_calls[{j}].id", "must be a string")
        arguments = fn.get("arguments")
        if arguments is not None and not isinstance(arguments, str | dict):
            raise _bad(f"{where}.tool_calls[{j}].function.arguments", "must be a string of JSON")


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
        if not isinstance(role, str) or role not in _ROLES:
            raise _bad(f"messages[{i}].role", f"must be one of {', '.join(sorted(_ROLES))}")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise _bad(f"messages[{i}].content", "must be a string, a list of content parts or null")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if not isinstance(part, dict | str):
                raise _bad(f"messages[{i}].content[{j}]", "must be a content part object")
        _check_message_fields(m, f"messages[{i}]")
    _check_tools(body)
    _check_response_format(body)
    if "logprobs" in body and not isinstance(body["logprobs"], bool | None):
        raise _bad("logprobs", "must be a boolean")
    top = body.get("top_logprobs")
    if top is not None and (not _is_int(top) or not 0 <= top <= 20):
        raise _bad("top_logprobs", "must be an integer from 0 to 20")
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
            or all(_is_int(p) for p in prompt)
            or all(isinstance(p, list) and all(_is_int(x) for x in p) for p in prompt)
        )
    )
    if not ok:
        raise _bad("prompt", "required: a string, a list of strings, a list of token ids or a list of id lists")
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool) and (not _is_int(logprobs) or not 0 <= logprobs <= 20):
        raise _bad("logprobs", "must be an integer from 0 to 20")
    return body
