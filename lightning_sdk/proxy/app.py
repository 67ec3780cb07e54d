"""The tracing proxy: an ASGI app (starlette) that serves the OpenAI API to agents and records every call.

Routes (the HTTP contract in docs/concepts.md / ARCHITECTURE.md)::

    POST /v1/chat/completions, POST /v1/completions, GET /v1/models     (also under /t/<attempt token>/v1/...)
    POST /v1/responses, POST /v1/messages[/count_tokens]                (proxy/surfaces: translated to the chat form)
    POST /lightning/v1/reward, POST /lightning/v1/finish                (attempt token)
    POST /lightning/v1/sessions, GET /lightning/v1/rollouts[/{id}]      (admin key)
    GET  /lightning/v1/health                                           (no key)
    GET  /metrics                                                       (no key: Prometheus, lightning_sdk.monitoring)
    /lightning/v1/store/...                                             (the store over HTTP, admin key)

One LLM call: read the body (413 over ``max_body_bytes``), parse and validate it (400 naming the field), resolve
the attempt from the token (path token wins over the bearer; 401 unknown, 409 not running), pick the backend by
model name (the policy backend, or LiteLLM for an external route), call it, answer the agent, and hand the call to
the ``Recorder`` that commits it in the background. Every response of a call the proxy opened carries the header
``X-Lightning-Call-Id: <call_id>`` (streamed or not, errors too), so an agent can give that call a per-call reward
(``POST /lightning/v1/reward {"call_id": ...}``). ``finish`` waits for the attempt's calls in flight, flushes its
records, then ends the attempt: a finished attempt's calls are committed before the answer.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.types import Receive, Scope, Send

from lightning_sdk.errors import AttemptNotRunningError, ConfigError, LightningSDKError, StoreUnavailableError
from lightning_sdk.http_errors import bearer_token
from lightning_sdk.monitoring import OpsMetrics, metrics_route
from lightning_sdk.proxy.admin import admin_routes
from lightning_sdk.proxy.attempts import AttemptCache, AttemptState
from lightning_sdk.proxy.backend import (
    CallContext,
    ChatResult,
    PolicyBackend,
    StreamItem,
    UpstreamHTTPError,
    relay_items,
)
from lightning_sdk.proxy.errors import (
    ProxyHTTPError,
    error_event,
    error_response,
    from_sdk_error,
    validate_chat,
    validate_completions,
)
from lightning_sdk.proxy.external import ExternalBackend, ExternalRoute
from lightning_sdk.proxy.recorder import Recorder
from lightning_sdk.proxy.shapes import canonical_chat, canonical_completion
from lightning_sdk.proxy.surfaces import COUNT_TOKENS_PATH, SURFACES, count_tokens, handle_surface
from lightning_sdk.store.base import Store
from lightning_sdk.types import Attempt, AttemptStatus, Call, now

__all__ = ["ABORTED", "CALL_ID_HEADER", "Proxy", "ProxyApp", "ProxyConfig", "create_app"]

logger = logging.getLogger(__name__)

_JSON = "application/json"
_SSE_DONE = b"data: [DONE]\n\n"
ABORTED = "the attempt was finished while this call was running: the call was aborted"
_TRANSPORT_KEYS = ("stream", "stream_options")  # not recorded: a streamed call records what the unstreamed one does


@dataclass
class ProxyConfig:
    """Knobs of the proxy app (all have working defaults)."""

    policy_models: list[str] | None = None  # names that mean the policy; None = any name not routed externally
    max_body_bytes: int = 32 * 1024 * 1024
    token_ttl_s: float = 2.0  # how long a resolved attempt token is trusted before re-reading the store
    version_ttl_s: float = 1.0  # how long the current policy version is cached
    models_ttl_s: float = 30.0
    public_url: str | None = None  # base of the URLs handed out by /sessions (default: from the request)
    max_control_body_bytes: int = 1024 * 1024  # reward, finish, sessions, rollouts (the store routes: max_body_bytes)
    read_timeout_s: float = 30.0  # an incomplete request body is answered 408 and closed after this much silence
    max_pending_records: int = 4096
    record_batch: int = 256
    call_timeout_s: float = 600.0  # how long one call may run (the passthrough's --timeout)
    finish_timeout_s: float | None = (
        None  # finish waits this long for calls in flight, then aborts (None: call_timeout_s)
    )
    cancel_on_disconnect: bool = True  # watch requests for the agent hanging up (then the upstream call is closed)
    hang_up_watch_after_s: float = 0.05  # arm that watch this far into a call (cheaper for fast calls; 0 = at once)
    metrics: bool = True  # serve GET /metrics (Prometheus; lightning_sdk.monitoring)


class Proxy:
    """The proxy's state and handlers; ``create_app`` wraps it in a starlette app (``app.state.proxy``)."""

    def __init__(
        self,
        store: Store,
        policy_backend: PolicyBackend,
        *,
        admin_key: str,
        external: ExternalBackend | None = None,
        config: ProxyConfig | None = None,
        close_store: bool = False,
        metrics: OpsMetrics | None = None,
    ) -> None:
        self.store = store
        self.close_store = close_store
        self.backend = policy_backend
        self.external = external
        self.admin_key = admin_key
        self.config = config or ProxyConfig()
        if metrics is None and self.config.metrics:
            metrics = OpsMetrics()
        self.metrics = metrics
        self.recorder = Recorder(
            store, max_pending=self.config.max_pending_records, max_batch=self.config.record_batch, metrics=metrics
        )
        if metrics is not None:
            metrics.refreshers.append(self._refresh_metrics)
        after_s = self.config.hang_up_watch_after_s
        self.hang_ups = HangUpSweeper(after_s) if after_s > 0 else None  # arms the calls' hang-up watches
        self.attempts = AttemptCache(
            store,
            ttl_s=self.config.token_ttl_s,
            busy=lambda attempt_id: self.recorder.pending_for(attempt_id) > 0,
            keep_calls=bool(getattr(policy_backend, "reads_earlier_calls", True)),
            settle=self.recorder.settle,
        )
        self._policy_names = frozenset(self.config.policy_models or ())
        self._version: tuple[float, int | None] = (-1e9, None)
        self._models: tuple[float, list[str]] = (-1e9, [])

    # -- helpers ---------------------------------------------------------------------------------------------------
    async def policy_version(self) -> int | None:
        at, version = self._version
        t = time.monotonic()
        if t - at > self.config.version_ttl_s:
            pv = await self.store.current_version()
            # before any publication the weights being served are the initial ones: version 0
            version = pv.version if pv is not None else 0
            self._version = (t, version)
        return version

    async def _refresh_metrics(self) -> None:
        """At scrape: rollouts by status and ready groups from the store, and the policy version served."""
        assert self.metrics is not None
        self.metrics.set_counts(await self.store.counts())
        version = None if self.metrics.version_is_read else await self.policy_version()
        if version is not None:
            self.metrics.policy_version.set(version)

    @staticmethod
    def token_of(request: Request) -> str | None:
        """The attempt token: the path's ``/t/<token>`` wins over the ``Authorization: Bearer`` header."""
        path_token = request.path_params.get("token")
        if path_token:
            return str(path_token)
        return bearer_token(request.headers)

    def backend_for(self, model: str) -> PolicyBackend | ExternalBackend:
        if self.external is not None and self.external.serves(model):
            return self.external
        if self._policy_names and model not in self._policy_names:
            known = sorted(self._policy_names | set(self.external.routes if self.external else ()))
            raise ProxyHTTPError(
                404,
                f"model {model!r} is not served here; known models: {', '.join(known)}",
                param="model",
                code="model_not_found",
            )
        return self.backend

    # -- LLM calls (raw ASGI: this is the hot path) -------------------------------------------------------------------
    async def handle_llm(self, scope: Scope, receive: Receive, send: Send, *, chat: bool, token: str | None) -> None:
        """Serve one ``/v1/chat/completions`` (``chat``) or ``/v1/completions`` request and record it.

        A call refused before its attempt is known (bad JSON, a bad field, a bad token) is not recorded; once it has
        a ``seq`` it is recorded, with its error when it failed (a refusal is never stored as an empty success).
        """
        started = now()
        state: AttemptState | None = None
        try:
            raw = await self._read_json(scope, receive)
            body = validate_chat(raw) if chat else validate_completions(raw)
            state = await self.attempts.resolve(token or bearer_token(scope["headers"]))
            state.enter()  # no await since resolve's check: finish sees this call or this call sees 409
        except ProxyHTTPError as err:
            await _send_error(send, err)
            return
        except LightningSDKError as exc:
            await _send_error(send, from_sdk_error(exc))
            return
        try:
            await self._serve_call(scope, receive, send, state, body, chat=chat, started=started)
        finally:
            state.leave()

    async def _serve_call(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        state: AttemptState,
        body: dict[str, Any],
        *,
        chat: bool,
        started: float,
    ) -> None:
        out = _Sent(send)
        ctx: CallContext | None = None
        result: ChatResult | None = None
        error: ProxyHTTPError | None = None
        watch: _HangUpWatch | None = None
        task = asyncio.current_task()
        try:
            backend = self.backend_for(body["model"])
            if not chat and isinstance(backend, ExternalBackend):
                raise ProxyHTTPError(
                    400, f"model {body['model']!r} is external: use /v1/chat/completions", param="model"
                )
            seq = await state.take_seq(self.store)
            ctx = CallContext(
                attempt=state.attempt,
                call_id=_call_id(),
                seq=seq,
                model=body["model"],
                policy_version=await self.policy_version(),
                split=state.split,
                _earlier=_earlier(state, self.store, seq),
            )
            state.call_ids.add(ctx.call_id)
            if task is not None:
                state.tasks.add(task)
            if self.config.cancel_on_disconnect:
                watch = _HangUpWatch(receive, task, self.hang_ups)
            try:
                if body.get("stream"):
                    if chat:
                        stream = backend.chat_stream(body, ctx)
                    else:
                        assert not isinstance(backend, ExternalBackend)
                        stream = backend.completions_stream(body, ctx)
                    first = await anext(stream)  # errors before the first byte still get a proper status code
                    result, error = await _relay(out, first, stream, ctx.call_id)
                elif chat:
                    result = await backend.chat(body, ctx)
                else:
                    assert not isinstance(backend, ExternalBackend)
                    result = await backend.completions(body, ctx)
            finally:
                if watch is not None:
                    watch.close()
        except UpstreamHTTPError as exc:
            error = ProxyHTTPError(exc.status_code, str(exc))
            error.payload = exc.payload
        except BaseException as exc:
            error = call_failure(exc, state, task, watch, f"call {ctx.call_id if ctx is not None else '?'}")
        finally:
            if task is not None:
                state.tasks.discard(task)
        call_id = ctx.call_id if ctx is not None else None
        if error is None and result is not None and not body.get("stream"):
            payload = orjson.dumps(result.response)
            await out({"type": "http.response.start", "status": 200, "headers": _json_headers(len(payload), call_id)})
            await out({"type": "http.response.body", "body": payload})
        elif error is not None and not out.started and error.status != 499:
            await _send_error(send, error, error.payload, call_id)
        elif error is not None and out.started and not out.ended and error.status != 499:
            await send({"type": "http.response.body", "body": error_event(error) + _SSE_DONE})
        if ctx is not None:
            await self._record(state, ctx, body, result if error is None else None, error, chat, started)

    async def _record(
        self,
        state: AttemptState,
        ctx: CallContext,
        body: dict[str, Any],
        result: ChatResult | None,
        error: ProxyHTTPError | None,
        chat: bool,
        started: float,
    ) -> None:
        """Queue the call for the store (with its error when it failed; never an empty success)."""
        try:
            call = self._make_call(ctx, body, result, chat, started)
        except ValueError as exc:  # the backend's result does not make a valid Call: record the failure instead
            logger.error("call %s: could not build the record (%s); recording it as failed", ctx.call_id, exc)
            call = self._make_call(ctx, body, None, chat, started)
            error = ProxyHTTPError(502, f"the answer could not be recorded: {exc}")
        if error is not None:
            call.error = error.message
            call.checks = {**call.checks, "http_status": error.status, "error_code": error.code or error.kind}
            if error.param is not None:
                call.checks["param"] = error.param
            state.n_errors += 1
        else:
            state.add_call(call)
        state.n_calls += 1
        await self.recorder.add_call(call)

    async def _read_json(self, scope: Scope, receive: Receive) -> Any:
        limit = self.config.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                raise ProxyHTTPError(413, f"request body of {int(value)} bytes is over the limit of {limit} bytes")
        message = await receive()  # the whole body is usually here already (silence before it: serve's protocol)
        data: bytes = message.get("body", b"")
        if message.get("more_body"):
            parts = [data]
            size = len(data)
            while message.get("more_body"):
                message = await _receive_within(receive, self.config.read_timeout_s)
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

    def _make_call(
        self, ctx: CallContext, body: dict[str, Any], result: ChatResult | None, chat: bool, started: float
    ) -> Call:
        """The recorded call: validated, unless the backend checked its result's fields (``ChatResult.checked``;
        the fields are then given in ``Call``'s order, which ``Call.from_checked`` takes as is)."""
        request = {k: v for k, v in body.items() if k not in _TRANSPORT_KEYS}
        attempt = ctx.attempt
        if result is None:
            is_policy = self.external is None or not self.external.serves(ctx.model)
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
        )

    # -- the finish barrier ----------------------------------------------------------------------------------------
    async def end_attempt(self, state: AttemptState, status: AttemptStatus, error: str | None) -> dict[str, Any]:
        """End the attempt behind ``state`` once every call and reward of it is committed (the barrier).

        New requests get 409 from the moment this starts. Calls in flight are waited for up to ``finish_timeout_s``
        (default: as long as a call may run); calls still running then are aborted (their upstream requests
        closed) and recorded as failed with ``ABORTED``. A call or reward that could not be recorded turns a
        ``succeeded`` into ``failed`` (it is never trained silently). Answers what happened.
        """
        if state.closing is not None:
            raise AttemptNotRunningError(f"attempt {state.attempt.attempt_id} is {state.closing}, no longer running")
        attempt_id = state.attempt.attempt_id
        state.closing = "finishing"
        t0 = time.monotonic()
        wait_s = self.config.finish_timeout_s
        if wait_s is None:
            wait_s = self.config.call_timeout_s
        aborted = 0
        try:
            try:
                await asyncio.wait_for(state.idle.wait(), wait_s)
            except TimeoutError:
                aborted = len(state.tasks)
                state.closing = "aborting"
                for task in list(state.tasks):
                    task.cancel()
                await asyncio.wait_for(state.idle.wait(), 30.0)
            failures = await self.recorder.commit(attempt_id, timeout=max(30.0, wait_s))
        except BaseException:
            state.closing = None  # nothing was ended: the agent may retry finish
            raise
        final, why = status, error
        if failures and status is AttemptStatus.SUCCEEDED:
            final = AttemptStatus.FAILED
            why = f"{len(failures)} calls/rewards of this attempt could not be recorded: {failures[0]}"
            logger.error("attempt %s: finished as failed: %s", attempt_id, why)
        try:
            attempt = await self.store.finish_attempt(attempt_id, final, why)
        except (StoreUnavailableError, asyncio.CancelledError):
            state.closing = None
            raise
        except BaseException:
            state.closing = "ended"
            raise
        self.attempts.ended(state.attempt.token, attempt)
        if self.metrics is not None:
            self.metrics.attempt_ended(attempt.status.value)
        lost_calls = sum(1 for f in failures if f.startswith("call "))
        return {
            "rollout_id": attempt.rollout_id,
            "attempt_id": attempt.attempt_id,
            "status": attempt.status.value,
            "calls": state.n_calls - lost_calls,
            "calls_failed": state.n_errors,
            "calls_not_recorded": lost_calls,
            "rewards_not_recorded": len(failures) - lost_calls,
            "inflight": {"waited_s": round(time.monotonic() - t0, 3), "aborted": aborted},
            **({"error": why} if why != error else {}),
        }

    async def finish_by_id(self, attempt_id: str, status: AttemptStatus, error: str | None) -> Attempt:
        """A store-side finish (admin store route) through the same barrier when this proxy serves the attempt."""
        state = self.attempts.state_of(attempt_id)
        if state is None or state.closing is not None:
            attempt = await self.store.finish_attempt(attempt_id, status, error)
            if state is not None:
                self.attempts.ended(state.attempt.token, attempt)
            return attempt
        await self.end_attempt(state, status, error)
        return state.attempt

    # -- models and health -----------------------------------------------------------------------------------------
    async def list_models(self, request: Request) -> Response:
        at, names = self._models
        t = time.monotonic()
        if t - at > self.config.models_ttl_s:
            if self.config.policy_models:
                names = list(self.config.policy_models)
            else:
                try:
                    names = await self.backend.models()
                except LightningSDKError as exc:
                    return error_response(from_sdk_error(exc))
            if self.external is not None:
                names = names + [n for n in self.external.routes if n not in names]
            self._models = (t, names)
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "lightning-sdk"} for n in names]
        return Response(orjson.dumps({"object": "list", "data": data}), media_type=_JSON)

    async def get_model(self, request: Request) -> Response:
        """``GET /v1/models/{id}`` (the OpenAI SDK's ``models.retrieve``): 404 for a model not served here."""
        model_id = request.path_params["model_id"]
        listed = await self.list_models(request)
        if listed.status_code != 200:
            return listed
        for entry in orjson.loads(listed.body)["data"]:
            if entry["id"] == model_id:
                return Response(orjson.dumps(entry), media_type=_JSON)
        return error_response(
            ProxyHTTPError(404, f"model {model_id!r} is not served here", param="model", code="model_not_found")
        )

    async def health(self, request: Request) -> Response:
        info: dict[str, Any] = {"status": "ok", "pending_records": self.recorder.pending}
        upstream = getattr(self.backend, "upstream_state", None)
        if callable(upstream):
            info["upstream"] = upstream()
        return Response(orjson.dumps(info), media_type=_JSON)

    # -- lifecycle -------------------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.recorder.start()
        start = getattr(self.backend, "start", None)
        if callable(start):
            await start()  # e.g. the passthrough's watch for an upstream that is not up yet
        try:
            yield
        finally:
            await self.recorder.stop()
            await self.backend.aclose()
            if self.close_store:
                await self.store.close()


def _earlier(state: AttemptState, store: Store, seq: int) -> Any:
    async def earlier() -> list[Call]:
        return await state.earlier_calls(store, seq)

    return earlier


# -- raw ASGI helpers of the hot path ----------------------------------------------------------------------------------
_ID_PREFIX = secrets.token_hex(6)
_ID_COUNTER = itertools.count(1)
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
CALL_ID_HEADER = b"x-lightning-call-id"
"""Response header of every LLM call the proxy opened: the recorded call's id (for per-call rewards)."""


def _call_id() -> str:
    """A unique call id (a per-process random prefix and a counter: no syscall on the hot path)."""
    return f"call-{_ID_PREFIX}{next(_ID_COUNTER):08x}"


def _json_headers(length: int, call_id: str | None = None) -> list[tuple[bytes, bytes]]:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(length).encode())]
    if call_id is not None:
        headers.append((CALL_ID_HEADER, call_id.encode()))
    return headers


async def _send_error(
    send: Send, err: ProxyHTTPError, payload: dict[str, Any] | None = None, call_id: str | None = None
) -> None:
    response = error_response(err, payload or err.payload)
    headers = response.raw_headers
    if call_id is not None:
        headers = [*headers, (CALL_ID_HEADER, call_id.encode())]
    await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": response.body})


class _HangUpWatch:
    """Cancel the task serving a request when the agent hangs up (which closes the upstream request too).

    After the request body is read, the server's ``receive()`` only returns once the client disconnects (or the
    response is complete); a done-callback on it cancels the serving task. The watch is armed ``after_s`` seconds
    into the call by a ``HangUpSweeper`` (one timer for all calls, not a task or a timer per call: a task per
    request was a tenth of the proxy's CPU per call on a small machine, a timer per request ~2 us); most fast calls
    end before that. A hang-up before that is seen when the watch is armed (the server remembers the disconnect),
    so an LLM generation is never left running for much more than ``after_s``. Without a sweeper it is armed at once.
    """

    __slots__ = ("_active", "_fut", "_receive", "_task", "gone")

    def __init__(
        self, receive: Receive, task: asyncio.Task[Any] | None = None, sweeper: HangUpSweeper | None = None
    ) -> None:
        self.gone = False
        self._active = True
        self._task = task if task is not None else asyncio.current_task()  # the task serving the request
        self._fut: asyncio.Future[Any] | None = None
        self._receive: Receive | None = receive
        if sweeper is not None:
            sweeper.add(self)
        else:
            self.arm()

    def arm(self) -> None:
        receive, self._receive = self._receive, None
        if self._active and receive is not None:
            self._fut = asyncio.ensure_future(receive())
            self._fut.add_done_callback(self._on_message)

    def _on_message(self, fut: asyncio.Future[Any]) -> None:
        if not self._active or fut.cancelled() or fut.exception() is not None:
            return
        if fut.result().get("type") == "http.disconnect" and self._task is not None:
            self.gone = True
            self._task.cancel()

    def close(self) -> None:
        self._active = False
        self._receive = self._task = None  # the sweeper may hold this watch a while longer: not the request's objects
        if self._fut is not None:
            self._fut.cancel()


class HangUpSweeper:
    """Arms each ``_HangUpWatch`` once its call has run ``after_s`` seconds, with one timer for all of them.

    Watches are queued in the order they start (so by deadline); the timer fires at the first deadline, arms every
    watch that is due (a closed one is dropped) and is set again no sooner than ``after_s / 4`` later, so a busy
    proxy runs it a few times per ``after_s`` instead of once per call. A watch is armed between ``after_s`` and
    ``1.25 * after_s`` into its call. One sweeper serves one event loop at a time (a new loop starts afresh).
    """

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        self.tick_s = after_s / 4
        self._loop: asyncio.AbstractEventLoop | None = None
        self._due: collections.deque[tuple[float, _HangUpWatch]] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None

    def add(self, watch: _HangUpWatch) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._loop, self._due, self._timer = loop, collections.deque(), None
        deadline = loop.time() + self.after_s
        self._due.append((deadline, watch))
        if self._timer is None:
            self._timer = loop.call_at(deadline, self._sweep)

    def _sweep(self) -> None:
        loop = self._loop
        if loop is None or asyncio.get_running_loop() is not loop:
            return  # a timer of a loop this sweeper has left
        self._timer = None
        t = loop.time()
        due = self._due
        while due and due[0][0] <= t:
            due.popleft()[1].arm()
        if due:
            self._timer = loop.call_at(max(due[0][0], t + self.tick_s), self._sweep)


async def _relay(
    send: Send, first: StreamItem, stream: AsyncIterator[StreamItem], call_id: str
) -> tuple[ChatResult | None, ProxyHTTPError | None]:
    """Send a backend's stream as server-sent events; returns its ``ChatResult`` or the error that cut it off.

    On an error the caller ends the stream with an error event and ``[DONE]`` (the response has started).
    """
    headers = [*_SSE_HEADERS, (CALL_ID_HEADER, call_id.encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})

    async def chunk(item: dict[str, Any] | bytes) -> None:
        data = item if isinstance(item, bytes) else orjson.dumps(item)
        await send({"type": "http.response.body", "body": b"data: " + data + b"\n\n", "more_body": True})

    try:
        result = await relay_items(first, stream, chunk)
    except LightningSDKError as exc:
        return None, from_sdk_error(exc)
    if result is None:
        return None, ProxyHTTPError(502, "the stream ended without a result", kind="upstream_error")
    await send({"type": "http.response.body", "body": _SSE_DONE})
    return result, None


def call_failure(
    exc: BaseException,
    state: AttemptState,
    task: asyncio.Task[Any] | None,
    watch: _HangUpWatch | None,
    what: str,
) -> ProxyHTTPError:
    """The error a call answers (when it still can) and is recorded with, when serving it raised ``exc``: a refusal
    as it is, an SDK error by the one error table, a stream that ended before it began (502), a finish that aborted
    it (409), the agent hanging up (499), a bug (500, logged: a bug must not lose the call). Call it from the
    ``except`` block; any other cancellation or ``BaseException`` is re-raised."""
    if isinstance(exc, ProxyHTTPError):
        return exc
    if isinstance(exc, LightningSDKError):
        return from_sdk_error(exc)
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


async def _receive_within(receive: Receive, timeout_s: float) -> Any:
    """The next ASGI message of the request body; 408 when the client sends nothing for ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):  # a timer, not a task per call (this is the hot path)
            return await receive()
    except TimeoutError:
        raise ProxyHTTPError(408, f"body: incomplete request, nothing received for {timeout_s:g}s") from None


class _LLMEndpoint:
    """The LLM routes as plain ASGI endpoints (mounted in the starlette router; the path token is a path param)."""

    def __init__(self, proxy: Proxy, *, chat: bool) -> None:
        self.proxy = proxy
        self.chat = chat

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("method") != "POST":
            await _send_error(send, ProxyHTTPError(405, f"method {scope.get('method')} not allowed"))
            return
        token = (scope.get("path_params") or {}).get("token")
        await self.proxy.handle_llm(scope, receive, send, chat=self.chat, token=token)


class ProxyApp:
    """The proxy's ASGI app: the LLM routes are dispatched directly, everything else goes to the starlette app.

    ``state.proxy`` is the ``Proxy``; ``starlette`` the app behind (add routes with ``extra_routes`` in
    ``create_app``).
    """

    def __init__(self, proxy: Proxy, starlette: Starlette) -> None:
        self.proxy = proxy
        self.starlette = starlette
        self.state = starlette.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path: str = scope["path"]
            token: str | None = None
            if path.startswith("/t/"):
                token, _, rest = path[3:].partition("/")
                path = "/" + rest
            if path == "/v1/chat/completions":
                return await self.proxy.handle_llm(scope, receive, send, chat=True, token=token or None)
            if path == "/v1/completions":
                return await self.proxy.handle_llm(scope, receive, send, chat=False, token=token or None)
            surface = SURFACES.get(path)  # the Responses and Messages APIs (lightning_sdk.proxy.surfaces)
            if surface is not None:
                return await handle_surface(self.proxy, surface, scope, receive, send, token or None)
            if path == COUNT_TOKENS_PATH:
                return await count_tokens(self.proxy, scope, receive, send, token or None)
        if scope["type"] == "http":
            replay = await self._read_body(scope, receive, send)
            if replay is None:
                return
            receive = replay
        await self.starlette(scope, receive, send)

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        """Read a request body within its route's limit and the read timeout, before any handler (or auth) runs.

        ``/lightning/v1/*`` control routes (reward, finish, sessions, rollouts) take ``max_control_body_bytes``,
        everything else (the store routes, other API surfaces) ``max_body_bytes``. Over the limit: 413 (by
        ``Content-Length`` before reading anything); silent for ``read_timeout_s``: 408; the client gone: nothing.
        Returns a ``receive`` that replays the body, or None when the request was answered here.
        """
        config = self.proxy.config
        path: str = scope["path"]
        control = "/lightning/v1/" in path and "/lightning/v1/store/" not in path
        limit = config.max_control_body_bytes if control else config.max_body_bytes
        try:
            for name, value in scope["headers"]:
                if name == b"content-length" and value.isdigit() and int(value) > limit:
                    raise ProxyHTTPError(413, f"request body of {int(value)} bytes is over the limit of {limit} bytes")
            parts: list[bytes] = []
            size = 0
            message = await receive()  # usually the whole body (silence before it: serve's protocol)
            while True:
                if parts:
                    message = await _receive_within(receive, config.read_timeout_s)
                if message["type"] == "http.disconnect":
                    logger.debug("%s %s: the client hung up while sending the body", scope["method"], path)
                    return None
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise ProxyHTTPError(413, f"request body is over the limit of {limit} bytes")
                parts.append(chunk)
                if not message.get("more_body"):
                    break
        except ProxyHTTPError as err:
            await _send_error(send, err)
            return None
        body = b"".join(parts)
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay


def create_app(
    store: Store,
    *,
    policy_backend: PolicyBackend,
    admin_key: str,
    external: list[ExternalRoute] | ExternalBackend | None = None,
    config: ProxyConfig | None = None,
    mount_store: bool = True,
    extra_routes: list[BaseRoute] | None = None,
    close_store: bool = False,
    metrics: OpsMetrics | None = None,
) -> ProxyApp:
    """The proxy as an ASGI app (``app.state.proxy`` is the ``Proxy``: its ``recorder``, ``attempts``, ...).

    ``external`` routes model names to providers through LiteLLM; ``mount_store`` serves the store's HTTP API at
    ``/lightning/v1/store`` (admin key); ``extra_routes`` are added to the app (e.g. the daemon's task queue);
    ``close_store`` closes the store when the app shuts down (after the last records are written); ``metrics``
    is what ``GET /metrics`` serves (a new ``OpsMetrics`` on its own registry when not given; none when
    ``config.metrics`` is false and none is given).
    """
    if not admin_key:
        raise ConfigError("create_app: an admin key is required")
    if isinstance(external, list):
        external = ExternalBackend(external) if external else None
    proxy = Proxy(
        store,
        policy_backend,
        admin_key=admin_key,
        external=external,
        config=config,
        close_store=close_store,
        metrics=metrics,
    )
    llm: list[BaseRoute] = [
        Route("/v1/chat/completions", _LLMEndpoint(proxy, chat=True), methods=["POST"]),
        Route("/v1/completions", _LLMEndpoint(proxy, chat=False), methods=["POST"]),
        Route("/v1/models", proxy.list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", proxy.get_model, methods=["GET"]),
    ]
    routes: list[BaseRoute] = [
        *llm,
        Mount("/t/{token}", routes=[*llm, *admin_routes(proxy, token_routes_only=True)]),
        Route("/lightning/v1/health", proxy.health, methods=["GET"]),
        *([metrics_route(proxy.metrics)] if proxy.metrics is not None else []),
        *admin_routes(proxy),
        *(extra_routes or ()),
    ]
    if mount_store:
        from lightning_sdk.store.http_server import store_routes

        routes.append(
            Mount("/lightning/v1/store", routes=store_routes(store, admin_key, finish_attempt=proxy.finish_by_id))
        )
    app = Starlette(routes=routes, lifespan=proxy.lifespan, exception_handlers={404: _not_found, 405: _not_allowed})
    app.state.proxy = proxy
    return ProxyApp(proxy, app)


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(ProxyHTTPError(404, f"no route {request.method} {request.url.path}"))


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(ProxyHTTPError(405, f"method {request.method} not allowed on {request.url.path}"))
