"""The one call pipeline: read -> validate -> resolve the attempt -> serve (stream or not) -> answer -> record.

Every LLM route of the proxy (chat completions, completions, the Responses and Messages APIs, each also under
``/t/<token>``) is served by ``serve_call`` with an ``Adapter`` that knows its API's shapes:

1. **read** the body (413 over ``max_body_bytes``, by ``Content-Length`` before reading; 408 when it stalls);
2. **validate** it: ``adapter.parse`` (400 naming the field, in the API's own error shape);
3. **resolve the attempt** from its token (the path's ``/t/<token>``, then ``Authorization: Bearer``, then
   ``x-api-key`` for the Anthropic surface; 401 unknown, 409 not running) and count the call in flight for the
   attempt's ``finish`` barrier in the same step (no ``await`` between the check and ``enter``);
4. **serve**: pick the backend by model name, give the call its ``seq`` and id, translate it to the chat form
   (``adapter.to_chat``: the identity for chat completions), call the backend, streamed (``adapter.stream_events``
   turns the backend's chunks into the API's server-sent events) or not;
5. **answer**: ``adapter.answer`` (200), or the error in the API's shape (``adapter.error_body``) with the status
   ``refusal`` gives it; a stream cut off after its first byte ends with the API's error event;
6. **record**: once the call has a ``seq`` it is recorded (``record_call``), with its error when it failed (a
   refusal is never stored as an empty success). A request refused before that (bad JSON, a bad field, a bad
   token) is not recorded.

Every answer of a call the proxy opened carries ``X-Lightning-Call-Id``. The observers (``proxy/observe.py``) see
each request's start and end; with none nothing is allocated for them. Errors are mapped in one place:
``refusal`` (the library's exceptions by the one table of ``lightning_sdk.http_errors``, an upstream's 4xx by
``upstream_refusal``), ``call_failure`` for what serving raised (cancellation, the agent hanging up, a bug).

Adding an API surface: one module with an ``Adapter`` (see ``proxy/surfaces``) and one line in the routing table
(``proxy/_app.py``'s ``llm_routes``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import orjson
from starlette.types import Receive, Scope, Send

from lightning_sdk.errors import LightningSDKError
from lightning_sdk.http_errors import bearer_token, error_headers
from lightning_sdk.proxy._attempts import AttemptState
from lightning_sdk.proxy._backend import (
    CallContext,
    ChatResult,
    PolicyBackend,
    StreamItem,
    UpstreamHTTPError,
    relay_items,
)
from lightning_sdk.proxy._errors import ProxyHTTPError, error_event, from_sdk_error, validate_chat, validate_completions
from lightning_sdk.proxy._external import ExternalBackend
from lightning_sdk.proxy._hangup import HangUpWatch
from lightning_sdk.proxy._shapes import canonical_chat, canonical_completion
from lightning_sdk.proxy.observe import CallEnd, CallStart, Mode, notify_ended, notify_started
from lightning_sdk.store.base import Store
from lightning_sdk.types import Call, now

if TYPE_CHECKING:
    from lightning_sdk.proxy._service import Proxy

__all__ = [
    "ABORTED",
    "CALL_ID_HEADER",
    "CHAT_COMPLETIONS",
    "COMPLETIONS",
    "Adapter",
    "EventStream",
    "Translation",
    "attempt_token",
    "call_failure",
    "read_json",
    "record_call",
    "refusal",
    "send_error",
    "serve_call",
    "upstream_refusal",
]

logger = logging.getLogger(__name__)

ABORTED = "the attempt was finished while this call was running: the call was aborted"
CALL_ID_HEADER = b"x-lightning-call-id"
"""Response header of every LLM call the proxy opened: the recorded call's id (for per-call rewards)."""

_SSE_DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_TRANSPORT_KEYS = ("stream", "stream_options")  # not recorded: a streamed call records what the unstreamed one does
_ID_PREFIX = secrets.token_hex(6)
_ID_COUNTER = itertools.count(1)


def new_call_id() -> str:
    """A unique call id (a per-process random prefix and a counter: no syscall on the hot path)."""
    return f"call-{_ID_PREFIX}{next(_ID_COUNTER):08x}"


IDEMPOTENCY_HEADER = b"idempotency-key"
"""Request header naming one logical call: the agent sends the same key when it makes the call again (its SDK's
retry, or a fail-over to another proxy after the first died before answering). ``LLM``'s clients send one."""
MAX_IDEMPOTENCY_KEY = 255


def resent_call_id(attempt_id: str, key: str) -> str:
    """The id of the call ``key`` names in ``attempt_id``: the same on every proxy, so a re-sent call replaces the
    first's record in the store (``Call.idempotency_key``)."""
    digest = hashlib.blake2b(f"{attempt_id}\0{key}".encode(), digest_size=10).hexdigest()
    return f"call-k{digest}"


def idempotency_key(scope: Scope) -> str | None:
    """The request's ``Idempotency-Key`` (None when absent); 400 for one that is empty or over 255 characters."""
    for name, value in scope["headers"]:
        if name == IDEMPOTENCY_HEADER:
            key = str(value.decode("latin-1")).strip()
            if not key or len(key) > MAX_IDEMPOTENCY_KEY:
                raise ProxyHTTPError(
                    400, f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY} characters", param="Idempotency-Key"
                )
            return key
    return None


# -- the adapter interface ---------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Translation:
    """A request in the chat form the backend serves, and what its adapter needs to answer it.

    ``chat``: the body the backend gets (chat completions: the request itself; a stream keeps ``stream`` and
    ``stream_options``, which are not recorded); ``record``: ``request["surface"]`` of the recorded call (surfaces);
    ``stop``: stop sequences the adapter cuts the text at; ``state``: adapter-specific (ids, name maps).
    """

    chat: dict[str, Any]
    record: dict[str, Any] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)


class EventStream(Protocol):
    """Turns one call's backend chunks into its API's server-sent events (bytes to send; ``b""``: nothing yet)."""

    def start(self) -> bytes:
        """What goes out before the first chunk (after the 200 headers)."""
        ...

    def feed(self, item: dict[str, Any] | bytes) -> bytes:
        """The events of one backend chunk (a dict, or one chunk's JSON bytes)."""
        ...

    def finish(self, result: ChatResult) -> bytes:
        """The closing events, given the call's result (the last body of the response)."""
        ...

    def error(self, err: ProxyHTTPError) -> bytes:
        """The events that end a stream cut off by ``err`` (the last body of the response)."""
        ...


class Adapter(Protocol):
    """One API surface over the chat-completions form (chat completions itself is the identity adapter).

    ``api``: its name in records and observers; ``chat``: served by the backend's chat methods (False: its
    completions methods); ``api_key_header``: the token may also come as ``x-api-key`` (Anthropic clients);
    ``reads_earlier_calls``: ``to_chat`` is given the attempt's earlier calls (else an empty list: the identity
    adapters need none, and a passthrough proxy then never loads them).
    """

    api: str
    chat: bool
    api_key_header: bool
    reads_earlier_calls: bool

    def parse(self, raw: Any) -> dict[str, Any]:
        """The validated request body (raise ``ProxyHTTPError`` 400 naming the field)."""
        ...

    def to_chat(self, body: dict[str, Any], ctx: CallContext, scope: Scope, earlier: list[Call]) -> Translation:
        """The request in the chat form (``earlier``: the attempt's calls before this one, when it reads them)."""
        ...

    def answer(self, t: Translation, result: ChatResult) -> bytes:
        """The JSON body of the 200 answer."""
        ...

    def stream_events(self, t: Translation, ctx: CallContext) -> EventStream:
        """A new event stream for one streamed call (made once the backend's first chunk is there: a backend that
        knows the prompt's length by then has set ``ctx.prompt_tokens``)."""
        ...

    def error_body(self, err: ProxyHTTPError) -> bytes:
        """The JSON body of an error answer in this API's shape."""
        ...

    def recorded(self, t: Translation | None, body: dict[str, Any], result: ChatResult | None) -> dict[str, Any]:
        """The recorded ``Call.request`` (``t`` None: the call failed before it was translated; ``result`` None:
        it failed). ``stream`` and ``stream_options`` are dropped from it."""
        ...


class _ChatEvents:
    """Chat and text completions streams: each chunk as a ``data:`` event, then ``data: [DONE]``."""

    __slots__ = ()

    def start(self) -> bytes:
        return b""

    def feed(self, item: dict[str, Any] | bytes) -> bytes:
        return b"data: " + (item if isinstance(item, bytes) else orjson.dumps(item)) + b"\n\n"

    def finish(self, result: ChatResult) -> bytes:
        return _SSE_DONE

    def error(self, err: ProxyHTTPError) -> bytes:
        return error_event(err) + _SSE_DONE


_CHAT_EVENTS = _ChatEvents()
_NOTHING: dict[str, Any] = {}
_NO_STOP: list[str] = []
_NO_CALLS: list[Call] = []


class _OpenAIAdapter:
    """``/v1/chat/completions`` (``chat``) and ``/v1/completions``: the identity adapter, the OpenAI error shape
    (an upstream's own OpenAI error body is passed on as it is)."""

    __slots__ = ("api", "chat", "parse")
    api_key_header = False
    reads_earlier_calls = False

    def __init__(self, api: str, chat: bool, parse: Callable[[Any], dict[str, Any]]) -> None:
        self.api = api
        self.chat = chat
        self.parse = parse  # the validator itself (one call less on the hot path)

    def to_chat(self, body: dict[str, Any], ctx: CallContext, scope: Scope, earlier: list[Call]) -> Translation:
        return Translation(body, _NOTHING, _NO_STOP, _NOTHING)  # never written to: shared, nothing allocated

    def answer(self, t: Translation, result: ChatResult) -> bytes:
        return orjson.dumps(result.response)

    def stream_events(self, t: Translation, ctx: CallContext) -> EventStream:
        return _CHAT_EVENTS

    def error_body(self, err: ProxyHTTPError) -> bytes:
        return orjson.dumps(err.payload or err.body())

    def recorded(self, t: Translation | None, body: dict[str, Any], result: ChatResult | None) -> dict[str, Any]:
        return body


CHAT_COMPLETIONS: Adapter = _OpenAIAdapter("chat.completions", True, validate_chat)
COMPLETIONS: Adapter = _OpenAIAdapter("completions", False, validate_completions)


# -- the pieces: token, body, errors -----------------------------------------------------------------------------------
def attempt_token(scope: Scope, path_token: str | None, api_key_header: bool = False) -> str | None:
    """The attempt token: the path's ``/t/<token>`` wins, then ``Authorization: Bearer``, then (``api_key_header``)
    ``x-api-key``."""
    if path_token:
        return path_token
    token = bearer_token(scope["headers"])
    if token or not api_key_header:
        return token
    for name, value in scope["headers"]:
        if name == b"x-api-key":
            return value.decode("latin-1").strip() or None
    return None


async def read_json(scope: Scope, receive: Receive, limit: int, read_timeout_s: float) -> Any:
    """The request body as JSON: 413 over ``limit`` bytes (by ``Content-Length`` before reading anything), 408
    when the client sends nothing for ``read_timeout_s`` mid-body, 400 for a client gone or invalid JSON."""
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise ProxyHTTPError(413, f"request body of {int(value)} bytes is over the limit of {limit} bytes")
    message = await receive()  # the whole body is usually here already (silence before it: serve's protocol)
    data: bytes = message.get("body", b"")
    if message.get("more_body"):
        parts = [data]
        size = len(data)
        while message.get("more_body"):
            message = await receive_within(receive, read_timeout_s)
            if message["type"] == "http.disconnect":
                raise ProxyHTTPError(400, "body: the client went away while sending it", param="body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise ProxyHTTPError(413, f"request body is over the limit of {limit} bytes")
            parts.append(chunk)
        data = b"".join(parts)
    elif len(data) > limit:
        raise ProxyHTTPError(413, f"request body is over the limit of {limit} bytes")
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ProxyHTTPError(400, f"body: invalid JSON ({exc})", param="body") from exc


async def receive_within(receive: Receive, timeout_s: float) -> Any:
    """The next ASGI message of the request body; 408 when the client sends nothing for ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):  # a timer, not a task per call (this is the hot path)
            return await receive()
    except TimeoutError:
        raise ProxyHTTPError(408, f"body: incomplete request, nothing received for {timeout_s:g}s") from None


def upstream_refusal(exc: UpstreamHTTPError) -> ProxyHTTPError:
    """An engine's or provider's HTTP error answer as this proxy's error, the one mapping of every route.

    The status is kept (a 400 stays 400, a 429 stays 429 with its ``Retry-After``); message, ``param``, ``code``
    and ``type`` come from the upstream's OpenAI error body when it has one; a prompt that does not fit (vLLM:
    "This model's maximum context length is N tokens ...") gets ``code="context_length_exceeded"``, so each
    surface can word it its own way (Anthropic clients act on "prompt is too long"). The upstream's own OpenAI
    body is kept as ``payload``: OpenAI-shaped answers (chat completions) pass it on as it is.
    """
    payload = exc.payload if isinstance(exc.payload, dict) else {}
    inner = payload.get("error", payload)
    message = str(exc)
    code: str | None = None
    param: str | None = None
    kind: str | None = None
    if isinstance(inner, dict):
        if isinstance(inner.get("message"), str) and inner["message"]:
            message = inner["message"]
        code = inner["code"] if isinstance(inner.get("code"), str) else None
        param = inner["param"] if isinstance(inner.get("param"), str) else None
        kind = inner["type"] if isinstance(inner.get("type"), str) else None
    if code is None and "maximum context length" in message:
        code = "context_length_exceeded"
    err = ProxyHTTPError(exc.status_code, message, code=code, param=param, kind=kind)
    if isinstance(payload.get("error"), dict):
        err.payload = payload
    if exc.retry_after_s is not None:
        err.headers.append((b"retry-after", str(max(0, math.ceil(exc.retry_after_s))).encode()))
    return err


def refusal(exc: LightningSDKError) -> ProxyHTTPError:
    """The HTTP error of one of the library's exceptions: a ``ProxyHTTPError`` as it is, an upstream's HTTP error
    by ``upstream_refusal``, anything else by the one error table (``from_sdk_error``)."""
    if isinstance(exc, UpstreamHTTPError):
        return upstream_refusal(exc)
    return from_sdk_error(exc)


def call_failure(
    exc: BaseException,
    state: AttemptState,
    task: asyncio.Task[Any] | None,
    watch: HangUpWatch | None,
    what: str,
) -> ProxyHTTPError:
    """The error a call answers (when it still can) and is recorded with, when serving it raised ``exc``: a refusal
    as ``refusal`` maps it, a stream that ended before it began (502), a finish that aborted it (409), the agent
    hanging up (499), a bug (500, logged: a bug must not lose the call). Call it from the ``except`` block; any
    other cancellation or ``BaseException`` is re-raised."""
    if isinstance(exc, LightningSDKError):
        return refusal(exc)
    if isinstance(exc, StopAsyncIteration):
        return ProxyHTTPError(502, "the backend's stream ended before it began", kind="upstream_error")
    if isinstance(exc, asyncio.CancelledError):
        if state.closing == "aborting":
            task.uncancel()  # type: ignore[union-attr]
            return ProxyHTTPError(409, ABORTED, code="attempt_finished")
        if watch is not None and watch.gone:
            task.uncancel()  # type: ignore[union-attr]
            return ProxyHTTPError(
                499, "the agent disconnected before the reply was complete", kind="client_closed_request"
            )
        raise exc
    if isinstance(exc, Exception):
        logger.exception("%s failed", what)
        return ProxyHTTPError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")
    raise exc


async def send_error(send: Send, adapter: Adapter, err: ProxyHTTPError, call_id: str | None = None) -> None:
    """Answer ``err`` in the adapter's error shape (with the headers every error of its status carries)."""
    body = adapter.error_body(err)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += error_headers(err.status) + err.headers
    if call_id is not None:
        headers.append((CALL_ID_HEADER, call_id.encode()))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _json_headers(length: int, call_id: str) -> list[tuple[bytes, bytes]]:
    return [
        (b"content-type", b"application/json"),
        (b"content-length", str(length).encode()),
        (CALL_ID_HEADER, call_id.encode()),
    ]


class _Sent:
    """A ``send`` that remembers whether the response has started and ended (to finish a cut stream properly)."""

    __slots__ = ("_send", "ended", "started")

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.ended = False

    async def __call__(self, message: Any) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        elif not message.get("more_body"):
            self.ended = True
        await self._send(message)


def _earlier(state: AttemptState, store: Store, seq: int, fresh: bool) -> Callable[[], Awaitable[list[Call]]]:
    """The attempt's calls before ``seq``; ``fresh``: read from the store (other proxies recorded some of them)."""

    async def earlier() -> list[Call]:
        if fresh:
            state.shed()
        return await state.earlier_calls(store, seq)

    return earlier


def _traceparent(scope: Scope) -> str | None:
    """The request's ``traceparent`` header (W3C trace context), for the observers; None when absent."""
    for name, value in scope["headers"]:
        if name == b"traceparent":
            return str(value.decode("latin-1"))
    return None


def _mode(backend: PolicyBackend | ExternalBackend | None) -> Mode | None:
    if backend is None:
        return None
    if isinstance(backend, ExternalBackend):
        return "external"
    return backend.mode


# -- the pipeline ------------------------------------------------------------------------------------------------------
async def serve_call(
    proxy: Proxy, adapter: Adapter, route: str, scope: Scope, receive: Receive, send: Send, path_token: str | None
) -> None:
    """Serve one request of an LLM route with ``adapter`` and record it (see the module docstring)."""
    observers = proxy.observers
    metrics = proxy.metrics
    start: CallStart | None = None
    t0 = time.perf_counter() if observers or metrics is not None else 0.0
    started = now()
    if metrics is not None:  # counted straight in (no event objects: proxy/_call_metrics.py)
        metrics.call_started()
    if observers:
        start = CallStart(adapter.api, route, started, t0, _traceparent(scope))
        notify_started(observers, start)
    body: dict[str, Any] | None = None
    try:
        config = proxy.config
        raw = await read_json(scope, receive, config.max_body_bytes, config.read_timeout_s)
        body = adapter.parse(raw)
        state = await proxy.attempts.resolve(attempt_token(scope, path_token, adapter.api_key_header))
        state.enter()  # no await since resolve's check: finish sees this call or this call sees 409
    except LightningSDKError as exc:
        err = refusal(exc)
        await send_error(send, adapter, err)
        if metrics is not None:
            metrics.call_ended(adapter.api, err.status, "none", time.perf_counter() - t0, 0, 0)
        if start is not None:
            model = body.get("model") if body is not None else None
            stream = bool(body.get("stream")) if body is not None else False
            end = CallEnd(
                start, err.status, stream, None, model if isinstance(model, str) else None, None, None,
                err.kind, err.code, None, None, time.perf_counter() - t0,
            )  # fmt: skip
            notify_ended(observers, end)
        return
    try:
        await _serve(proxy, adapter, scope, receive, send, state, body, started, t0, start)
    finally:
        state.leave()


async def _serve(
    proxy: Proxy,
    adapter: Adapter,
    scope: Scope,
    receive: Receive,
    send: Send,
    state: AttemptState,
    body: dict[str, Any],
    started: float,
    t0: float,
    start: CallStart | None,
) -> None:
    out = _Sent(send)
    ctx: CallContext | None = None
    t: Translation | None = None
    events: EventStream | None = None
    backend: PolicyBackend | ExternalBackend | None = None
    result: ChatResult | None = None
    error: ProxyHTTPError | None = None
    watch: HangUpWatch | None = None
    first_at: float | None = None
    task = asyncio.current_task()
    stream = bool(body.get("stream"))
    commit: _StreamCommit | None = None
    try:
        seq = await state.take_seq(proxy.store)
        if proxy.shared is not None:  # unique across the proxies serving this attempt (proxy/_shared.py)
            seq = await proxy.shared.reserve_seq(state.attempt.attempt_id)
        key = idempotency_key(scope)
        ctx = CallContext(
            attempt=state.attempt,
            call_id=new_call_id() if key is None else resent_call_id(state.attempt.attempt_id, key),
            seq=seq,
            model=body["model"],
            policy_version=await proxy.policy_version(),
            split=state.split,
            idempotency_key=key,
            _earlier=_earlier(state, proxy.store, seq, proxy.shared is not None),
        )
        state.call_ids.add(ctx.call_id)
        if task is not None:
            state.tasks.add(task)
        # after the context: a refused model name (404 model_not_found) is recorded as a failed call
        backend = proxy.backend_for(body["model"])
        if not adapter.chat and isinstance(backend, ExternalBackend):
            raise ProxyHTTPError(400, f"model {body['model']!r} is external: use /v1/chat/completions", param="model")
        t = adapter.to_chat(body, ctx, scope, await ctx.earlier_calls() if adapter.reads_earlier_calls else _NO_CALLS)
        if proxy.config.cancel_on_disconnect:
            watch = HangUpWatch(receive, task, proxy.hang_ups)
        try:
            if stream:
                items = _open_stream(backend, adapter.chat, t.chat, ctx)
                first = await anext(items)  # errors before the first byte still get a proper status code
                if start is not None:  # time to the first chunk: only the observers' events carry it
                    first_at = time.perf_counter()
                events = adapter.stream_events(t, ctx)
                if proxy.commits is not None:  # a shared store: committed before the stream's final event
                    commit = _StreamCommit(proxy, state, ctx, adapter, t, body, started)
                result, error = await _relay(out, events, first, items, ctx.call_id, commit)
            elif adapter.chat:
                result = await backend.chat(t.chat, ctx)
            else:
                assert not isinstance(backend, ExternalBackend)
                result = await backend.completions(t.chat, ctx)
        finally:
            if watch is not None:
                watch.close()
    except BaseException as exc:  # a bug in a translation must not lose the call either (500, recorded)
        error = call_failure(exc, state, task, watch, f"{adapter.api} call {ctx.call_id if ctx is not None else '?'}")
    finally:
        if task is not None:
            state.tasks.discard(task)
    call_id = ctx.call_id if ctx is not None else None
    call: Call | None = None
    recorded = False
    if commit is not None and commit.done:
        call, recorded = commit.call, True
    if proxy.commits is not None and error is None and result is not None and not stream and ctx is not None:
        # a shared store: the call is committed, then answered (proxy/_shared.py)
        try:
            call = await record_call(proxy, state, ctx, adapter.recorded(t, body, result), result, None,
                                     adapter.chat, started)  # fmt: skip
            recorded = True
        except LightningSDKError as exc:  # its attempt ended on another proxy, or the store failed
            error, recorded = refusal(exc), True
    if error is None and result is not None and not stream and t is not None and call_id is not None:
        payload = adapter.answer(t, result)
        await out({"type": "http.response.start", "status": 200, "headers": _json_headers(len(payload), call_id)})
        await out({"type": "http.response.body", "body": payload})
    elif error is not None and not out.started and error.status != 499:
        await send_error(send, adapter, error, call_id)
    elif error is not None and out.started and not out.ended and error.status != 499 and events is not None:
        with contextlib.suppress(Exception):  # the agent may be gone
            await out({"type": "http.response.body", "body": events.error(error)})
    if ctx is not None and not recorded:
        ok = result if error is None else None
        try:
            call = await record_call(proxy, state, ctx, adapter.recorded(t, body, ok), ok, error, adapter.chat, started)
        except LightningSDKError as exc:  # a shared store refused it after the answer (a stream, an error)
            logger.warning("call %s: not recorded: %s", ctx.call_id, exc)
    metrics = proxy.metrics
    if metrics is None and start is None:
        return
    status = 200 if error is None or (out.started and error.status != 499) else error.status
    duration = time.perf_counter() - t0
    if metrics is not None:
        mode = _mode(backend) or "none"
        if call is None:
            metrics.call_ended(adapter.api, status, mode, duration, 0, 0)
        else:
            metrics.call_ended(adapter.api, status, mode, duration, len(call.prompt_ids), len(call.completion_ids))
    if start is not None:
        attempt = state.attempt
        end = CallEnd(
            start, status, stream, _mode(backend), body["model"], attempt.attempt_id, attempt.rollout_id,
            error.kind if error is not None else None, error.code if error is not None else None, call,
            first_at - t0 if first_at is not None else None, duration,
        )  # fmt: skip
        notify_ended(proxy.observers, end)


class _StreamCommit:
    """A shared store's commit of a streamed call, run by ``_relay`` after the last content chunk and before the
    stream's final event (``done``: it ran, so the call is recorded or was refused; ``call``: the committed one)."""

    __slots__ = ("adapter", "body", "call", "ctx", "done", "proxy", "started", "state", "t")

    def __init__(
        self,
        proxy: Proxy,
        state: AttemptState,
        ctx: CallContext,
        adapter: Adapter,
        t: Translation,
        body: dict[str, Any],
        started: float,
    ) -> None:
        self.proxy, self.state, self.ctx, self.adapter, self.t = proxy, state, ctx, adapter, t
        self.body, self.started = body, started
        self.call: Call | None = None
        self.done = False

    async def __call__(self, result: ChatResult) -> ProxyHTTPError | None:
        self.done = True
        a = self.adapter
        try:
            self.call = await record_call(self.proxy, self.state, self.ctx, a.recorded(self.t, self.body, result),
                                          result, None, a.chat, self.started)  # fmt: skip
        except LightningSDKError as exc:  # its attempt ended on another proxy, or the store failed
            return refusal(exc)
        return None


def _open_stream(
    backend: PolicyBackend | ExternalBackend, chat: bool, body: dict[str, Any], ctx: CallContext
) -> AsyncIterator[StreamItem]:
    if chat:
        return backend.chat_stream(body, ctx)
    assert not isinstance(backend, ExternalBackend)
    return backend.completions_stream(body, ctx)


async def _relay(
    out: _Sent,
    events: EventStream,
    first: StreamItem,
    items: AsyncIterator[StreamItem],
    call_id: str,
    before_end: Callable[[ChatResult], Awaitable[ProxyHTTPError | None]] | None = None,
) -> tuple[ChatResult | None, ProxyHTTPError | None]:
    """Send a backend's stream as the adapter's server-sent events; returns its ``ChatResult`` or the error that cut
    it off (the caller then ends the started stream with the adapter's error event). ``before_end`` runs after the
    last content chunk and before the final event (a shared store's commit): an error it returns ends the stream
    instead, so an agent never reads a whole stream whose call is not committed."""
    await out(
        {"type": "http.response.start", "status": 200, "headers": [*_SSE_HEADERS, (CALL_ID_HEADER, call_id.encode())]}
    )

    async def chunk(item: dict[str, Any] | bytes) -> None:
        data = events.feed(item)
        if data:
            await out({"type": "http.response.body", "body": data, "more_body": True})

    head = events.start()
    if head:
        await out({"type": "http.response.body", "body": head, "more_body": True})
    try:
        result = await relay_items(first, items, chunk)
    except LightningSDKError as exc:
        return None, refusal(exc)
    if result is None:
        return None, ProxyHTTPError(502, "the stream ended without a result", kind="upstream_error")
    if before_end is not None and (refused := await before_end(result)) is not None:
        return None, refused
    await out({"type": "http.response.body", "body": events.finish(result)})
    return result, None


# -- recording ---------------------------------------------------------------------------------------------------------
async def record_call(
    proxy: Proxy,
    state: AttemptState,
    ctx: CallContext,
    request: dict[str, Any],
    result: ChatResult | None,
    error: ProxyHTTPError | None,
    chat: bool,
    started: float,
) -> Call:
    """Queue the call for the store (with its error when it failed; never an empty success); returns it."""
    try:
        call = _make_call(proxy, ctx, request, result, chat, started)
    except ValueError as exc:  # the backend's result does not make a valid Call: record the failure instead
        logger.error("call %s: could not build the record (%s); recording it as failed", ctx.call_id, exc)
        call = _make_call(proxy, ctx, request, None, chat, started)
        error = ProxyHTTPError(502, f"the answer could not be recorded: {exc}")
    if error is not None:
        call.error = error.message
        call.checks = {**call.checks, "http_status": error.status, "error_code": error.code or error.kind}
        if error.param is not None:
            call.checks["param"] = error.param
        state.n_errors += 1
    else:
        state.add_call(call)
    if state.first_of(call):
        state.n_calls += 1
    if proxy.commits is not None:
        await proxy.commits.commit(call)  # raises when the store refused it (its attempt ended elsewhere)
    else:
        await proxy.recorder.add_call(call)
    return call


def _make_call(
    proxy: Proxy, ctx: CallContext, body: dict[str, Any], result: ChatResult | None, chat: bool, started: float
) -> Call:
    """The recorded call: validated, unless the backend checked its result's fields (``ChatResult.checked``; the
    fields are then given in ``Call``'s order, which ``Call.from_checked`` takes as is)."""
    request = {k: v for k, v in body.items() if k not in _TRANSPORT_KEYS}
    attempt = ctx.attempt
    if result is None:
        external = proxy.external
        is_policy = external is None or not external.serves(ctx.model)
        return Call(
            call_id=ctx.call_id,
            attempt_id=attempt.attempt_id,
            rollout_id=attempt.rollout_id,
            seq=ctx.seq,
            model=ctx.model,
            is_policy=is_policy,
            token_source="engine" if is_policy else "external",
            request=request,
            policy_version=ctx.policy_version,
            started_at=started,
            ended_at=now(),
            idempotency_key=ctx.idempotency_key,
        )
    return (Call.from_checked if result.checked else Call)(
        call_id=ctx.call_id,
        attempt_id=attempt.attempt_id,
        rollout_id=attempt.rollout_id,
        seq=ctx.seq,
        model=ctx.model,
        is_policy=result.is_policy,
        token_source=result.token_source,
        request=request,
        response=canonical_chat(result.response) if chat else canonical_completion(result.response),
        prompt_ids=result.prompt_ids,
        completion_ids=result.completion_ids,
        logprobs=result.logprobs,
        policy_version=result.policy_version if result.policy_version is not None else ctx.policy_version,
        finish_reason=result.finish_reason,
        usage=result.usage,
        checks=result.checks,
        started_at=started,
        ended_at=now(),
        error=None,
        idempotency_key=ctx.idempotency_key,
    )
