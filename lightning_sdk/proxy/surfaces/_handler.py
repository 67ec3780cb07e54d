"""Serve one surface request (Responses or Messages) through the policy backend and record it like a chat call.

The flow is the chat-completions one (``Proxy.handle_llm``): read the body (413), validate it (400 naming the
field), resolve the attempt from its token (path token, then ``Authorization: Bearer``, then ``x-api-key``; 401
unknown, 409 not running), translate to the chat form, call the backend, translate the answer back, and record the
call. The recorded ``Call.request`` is the chat form the backend served (so the bridge and the records treat every
surface alike) plus ``request["surface"]``: which API, the original request (for inspection), the session headers,
the tools the policy was not shown, the ids the proxy handed out and what the agent was shown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from starlette.types import Receive, Scope, Send

from lightning_sdk.errors import LightningSDKError
from lightning_sdk.http_errors import bearer_token, error_headers
from lightning_sdk.proxy.backend import CallContext, ChatResult, StreamItem, UpstreamHTTPError, relay_items
from lightning_sdk.proxy.errors import ProxyHTTPError, _bad, from_sdk_error, validate_chat
from lightning_sdk.proxy.surfaces._chat import PriorReplies, Reply
from lightning_sdk.types import now

__all__ = [
    "SESSION_HEADERS",
    "Surface",
    "SurfaceStream",
    "Translation",
    "attempt_token",
    "chat_form",
    "check_common",
    "handle_surface",
    "original_request",
]

logger = logging.getLogger(__name__)

SESSION_HEADERS = (b"x-claude-code-session-id", b"session-id", b"thread-id")
"""Request headers kept on the recorded call (``request["surface"]["headers"]``)."""

_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


@dataclass
class Translation:
    """A surface request in the chat form, and what the surface needs to answer it."""

    chat: dict[str, Any]  # the chat-completions body the backend serves
    record: dict[str, Any]  # request["surface"] of the recorded call
    stop: list[str] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)  # surface-specific (ids, name maps)


class SurfaceStream(Protocol):
    """Turns a backend's chat chunks into the surface's server-sent events."""

    def start(self) -> list[bytes]: ...

    def feed(self, chunk: dict[str, Any]) -> list[bytes]: ...

    def finish(self, reply: Reply) -> list[bytes]: ...

    def error(self, err: ProxyHTTPError) -> bytes: ...


class Surface(Protocol):
    """One API surface over the chat form (``responses.ResponsesSurface``, ``messages.MessagesSurface``)."""

    api: str

    def validate(self, raw: Any) -> dict[str, Any]: ...

    def translate(self, body: dict[str, Any], prior: PriorReplies, call_id: str) -> Translation: ...

    def answer(self, t: Translation, reply: Reply) -> dict[str, Any]: ...

    def stream(self, t: Translation) -> SurfaceStream: ...

    def refs(self, t: Translation, reply: Reply) -> list[str]: ...

    def error_body(self, err: ProxyHTTPError) -> bytes: ...


def attempt_token(scope: Scope, path_token: str | None) -> str | None:
    """The attempt token: the path's ``/t/<token>`` wins, then ``Authorization: Bearer``, then ``x-api-key``."""
    if path_token:
        return path_token
    token = bearer_token(scope["headers"])
    if token:
        return token
    for name, value in scope["headers"]:
        if name == b"x-api-key":
            return value.decode("latin-1").strip() or None
    return None


def session_headers(scope: Scope) -> dict[str, str]:
    return {name.decode(): value.decode("latin-1") for name, value in scope["headers"] if name in SESSION_HEADERS}


async def send_error(send: Send, surface: Surface, err: ProxyHTTPError, call_id: str | None = None) -> None:
    """Answer ``err`` in the surface's error shape (with the headers every error of its status carries)."""
    from lightning_sdk.proxy.app import CALL_ID_HEADER

    body = surface.error_body(err)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += error_headers(err.status) + err.headers
    if call_id is not None:
        headers.append((CALL_ID_HEADER, call_id.encode()))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _chunk_dict(item: StreamItem) -> dict[str, Any]:
    if isinstance(item, bytes):
        data: dict[str, Any] = orjson.loads(item)
        return data
    assert isinstance(item, dict)
    return item


async def handle_surface(
    proxy: Any, surface: Surface, scope: Scope, receive: Receive, send: Send, path_token: str | None
) -> None:
    """Serve one surface request on ``proxy`` (a ``lightning_sdk.proxy.app.Proxy``) and record it.

    As for chat completions: a request refused before its attempt is known (bad JSON, a bad field, a bad token)
    is not recorded; once the call has a ``seq`` it is recorded, with its error when it failed. The call counts as
    in flight for the attempt's ``finish`` barrier from the moment its token is checked.
    """
    started = now()
    try:
        raw = await proxy._read_json(scope, receive)
        body = surface.validate(raw)
        state = await proxy.attempts.resolve(attempt_token(scope, path_token))
        state.enter()  # no await since resolve's check: finish sees this call or this call sees 409
    except LightningSDKError as exc:  # a ProxyHTTPError answers as it is
        await send_error(send, surface, from_sdk_error(exc))
        return
    try:
        await _serve(proxy, surface, scope, receive, send, state, body, started)
    finally:
        state.leave()


async def _serve(
    proxy: Any,
    surface: Surface,
    scope: Scope,
    receive: Receive,
    send: Send,
    state: Any,
    body: dict[str, Any],
    started: float,
) -> None:
    from lightning_sdk.proxy import app as _app  # the app imports this package: bind its helpers at call time

    out = _app._Sent(send)
    ctx: CallContext | None = None
    t: Translation | None = None
    events: SurfaceStream | None = None
    result: ChatResult | None = None
    error: ProxyHTTPError | None = None
    watch = None
    task = asyncio.current_task()
    stream = bool(body.get("stream"))
    try:
        backend = proxy.backend_for(body["model"])
        seq = await state.take_seq(proxy.store)
        ctx = CallContext(
            attempt=state.attempt,
            call_id=_app._call_id(),
            seq=seq,
            model=body["model"],
            policy_version=await proxy.policy_version(),
            split=state.split,
            _earlier=_app._earlier(state, proxy.store, seq),
        )
        state.call_ids.add(ctx.call_id)
        if task is not None:
            state.tasks.add(task)
        t = surface.translate(body, PriorReplies(await ctx.earlier_calls()), ctx.call_id)
        validate_chat(t.chat)  # the checks chat completions get (names in errors are the chat form's)
        t.record["headers"] = session_headers(scope)
        if proxy.config.cancel_on_disconnect:
            watch = _app._HangUpWatch(receive, task, proxy.hang_ups)
        try:
            if stream:
                chat = dict(t.chat, stream=True, stream_options={"include_usage": True})
                items = backend.chat_stream(chat, ctx)
                first = await anext(items)  # errors before the first byte still get a proper status code
                events = surface.stream(t)
                result, error = await _relay(out, events, first, items, ctx.call_id, t.stop)
            else:
                result = await backend.chat(t.chat, ctx)
        finally:
            if watch is not None:
                watch.close()
    except UpstreamHTTPError as exc:
        error = upstream_refusal(exc)
    except BaseException as exc:  # a bug in a translation must not lose the call either (500, recorded)
        error = _app.call_failure(exc, state, task, watch, f"{surface.api} surface")
    finally:
        if task is not None:
            state.tasks.discard(task)
    call_id = ctx.call_id if ctx is not None else None
    if error is None and result is not None and not stream and t is not None:
        payload = orjson.dumps(surface.answer(t, Reply.from_chat(result.response, t.stop)))
        await out({"type": "http.response.start", "status": 200, "headers": _app._json_headers(len(payload), call_id)})
        await out({"type": "http.response.body", "body": payload})
    elif error is not None and not out.started and error.status != 499:
        await send_error(send, surface, error, call_id)
    elif error is not None and out.started and not out.ended and error.status != 499 and events is not None:
        with contextlib.suppress(Exception):  # the agent may be gone
            await out({"type": "http.response.body", "body": events.error(error)})
    if ctx is None:
        return
    recorded = dict(t.chat) if t is not None else {"model": body["model"]}
    if t is not None:
        if result is not None and error is None:
            reply = Reply.from_chat(result.response, t.stop)
            t.record["shown"] = reply.shown()
            t.record["refs"] = surface.refs(t, reply)
        recorded["surface"] = t.record
    else:
        recorded["surface"] = {"api": surface.api, "request": {k: v for k, v in body.items() if k != "stream"}}
    await proxy._record(state, ctx, recorded, result if error is None else None, error, True, started)


def upstream_refusal(exc: UpstreamHTTPError) -> ProxyHTTPError:
    """The engine's 4xx as this proxy's error: its message, and ``context_length_exceeded`` when the engine says
    the prompt does not fit (vLLM: "This model's maximum context length is N tokens ..."), so each surface can
    word it its own way (Anthropic clients act on "prompt is too long")."""
    payload = exc.payload or {}
    inner = payload.get("error", payload) if isinstance(payload, dict) else None
    message = str(exc)
    code: str | None = None
    if isinstance(inner, dict):
        if isinstance(inner.get("message"), str):
            message = inner["message"]
        if isinstance(inner.get("code"), str):
            code = inner["code"]
    if code is None and "maximum context length" in message:
        code = "context_length_exceeded"
    return ProxyHTTPError(exc.status_code, message, code=code)


async def _relay(
    out: Send,
    events: SurfaceStream,
    first: StreamItem,
    items: AsyncIterator[StreamItem],
    call_id: str,
    stop: list[str],
) -> tuple[ChatResult | None, ProxyHTTPError | None]:
    """Send the surface's events for a backend stream; returns its ``ChatResult`` or the error that cut it off
    (the caller ends the started stream with the surface's error event)."""
    from lightning_sdk.proxy.app import CALL_ID_HEADER

    headers = [*_SSE_HEADERS, (CALL_ID_HEADER, call_id.encode())]
    await out({"type": "http.response.start", "status": 200, "headers": headers})

    async def emit(chunks: list[bytes]) -> None:
        if chunks:
            await out({"type": "http.response.body", "body": b"".join(chunks), "more_body": True})

    async def chunk(item: dict[str, Any] | bytes) -> None:
        await emit(events.feed(_chunk_dict(item)))

    await emit(events.start())
    try:
        result = await relay_items(first, items, chunk)
    except UpstreamHTTPError as exc:
        return None, upstream_refusal(exc)
    except LightningSDKError as exc:
        return None, from_sdk_error(exc)
    if result is None:
        return None, ProxyHTTPError(502, "the stream ended without a result", kind="upstream_error")
    await out({"type": "http.response.body", "body": b"".join(events.finish(Reply.from_chat(result.response, stop)))})
    return result, None


def check_common(raw: Any) -> dict[str, Any]:
    """The checks every surface's request passes first (400 naming the field): a JSON object with a non-empty
    ``model``; ``stream`` a boolean; ``temperature`` and ``top_p`` numbers; ``tools`` a list."""
    if not isinstance(raw, dict):
        raise _bad("body", "the request body must be a JSON object")
    if not isinstance(raw.get("model"), str) or not raw["model"]:
        raise _bad("model", "required, a non-empty string")
    if "stream" in raw and not isinstance(raw["stream"], bool | None):
        raise _bad("stream", "must be a boolean")
    for key in _SAMPLING:
        value = raw.get(key)
        if value is not None and (not isinstance(value, int | float) or isinstance(value, bool)):
            raise _bad(key, "must be a number")
    if raw.get("tools") is not None and not isinstance(raw["tools"], list):
        raise _bad("tools", "must be a list")
    return raw


def chat_form(body: dict[str, Any], messages: list[Any], tools: list[Any]) -> dict[str, Any]:
    """The start of the chat form of a surface request: model, messages, the tools shown, the sampling settings."""
    chat: dict[str, Any] = {"model": body["model"], "messages": messages}
    if tools:
        chat["tools"] = tools
    chat.update({key: body[key] for key in _SAMPLING if body.get(key) is not None})
    return chat


def original_request(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the agent sent it, for the record (``stream`` is a transport detail)."""
    return {k: v for k, v in body.items() if k != "stream"}


_SAMPLING = ("temperature", "top_p")


def sse(event: str, data: dict[str, Any]) -> bytes:
    """One server-sent event with a name (both surfaces name their events)."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
