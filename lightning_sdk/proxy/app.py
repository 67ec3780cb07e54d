"""The tracing proxy: an ASGI app (starlette) that serves the OpenAI API to agents and records every call.

Routes (the HTTP contract in docs/concepts.md / ARCHITECTURE.md)::

    POST /v1/chat/completions, POST /v1/completions, GET /v1/models     (also under /t/<attempt token>/v1/...)
    POST /lightning/v1/reward, POST /lightning/v1/finish                (attempt token)
    POST /lightning/v1/sessions, GET /lightning/v1/rollouts[/{id}]      (admin key)
    GET  /lightning/v1/health                                           (no key)
    /lightning/v1/store/...                                             (the store over HTTP, admin key)

One LLM call: read the body (413 over ``max_body_bytes``), parse and validate it (400 naming the field), resolve
the attempt from the token (path token wins over the bearer; 401 unknown, 409 not running), pick the backend by
model name (the policy backend, or LiteLLM for an external route), call it, answer the agent, and hand the call to
the ``Recorder`` that commits it in the background. ``finish`` waits for the attempt's calls in flight, flushes its
records, then ends the attempt: a finished attempt's calls are committed before the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Mount, Route

from lightning_sdk.errors import LightningSDKError
from lightning_sdk.proxy.admin import admin_routes
from lightning_sdk.proxy.attempts import AttemptCache, AttemptState
from lightning_sdk.proxy.backend import CallContext, ChatResult, PolicyBackend, StreamItem, UpstreamHTTPError
from lightning_sdk.proxy.errors import (
    ProxyHTTPError,
    error_response,
    from_sdk_error,
    validate_chat,
    validate_completions,
)
from lightning_sdk.proxy.external import ExternalBackend, ExternalRoute
from lightning_sdk.proxy.recorder import Recorder
from lightning_sdk.proxy.shapes import canonical_chat, canonical_completion
from lightning_sdk.store.base import Store
from lightning_sdk.types import Call, new_id, now

__all__ = ["Proxy", "ProxyConfig", "create_app"]

logger = logging.getLogger(__name__)

_JSON = "application/json"
_SSE_DONE = b"data: [DONE]\n\n"
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
    max_pending_records: int = 4096
    record_batch: int = 256
    finish_timeout_s: float = 120.0
    cancel_on_disconnect: bool = True  # watch non-streaming requests for the agent hanging up


class _ClientGone(Exception):
    pass


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
    ) -> None:
        self.store = store
        self.backend = policy_backend
        self.external = external
        self.admin_key = admin_key
        self.config = config or ProxyConfig()
        self.attempts = AttemptCache(store, ttl_s=self.config.token_ttl_s)
        self.recorder = Recorder(store, max_pending=self.config.max_pending_records, max_batch=self.config.record_batch)
        self._policy_names = frozenset(self.config.policy_models or ())
        self._version: tuple[float, int | None] = (-1e9, None)
        self._models: tuple[float, list[str]] = (-1e9, [])

    # -- helpers ---------------------------------------------------------------------------------------------------
    async def policy_version(self) -> int | None:
        at, version = self._version
        t = time.monotonic()
        if t - at > self.config.version_ttl_s:
            pv = await self.store.current_version()
            version = pv.version if pv is not None else None
            self._version = (t, version)
        return version

    async def read_json(self, request: Request) -> Any:
        limit = self.config.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise ProxyHTTPError(413, f"request body of {length} bytes is over the limit of {limit} bytes")
        chunks = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ProxyHTTPError(413, f"request body is over the limit of {limit} bytes")
            chunks.append(chunk)
        try:
            return orjson.loads(b"".join(chunks))
        except orjson.JSONDecodeError as exc:
            raise ProxyHTTPError(400, f"body: invalid JSON ({exc})", param="body") from exc

    @staticmethod
    def token_of(request: Request) -> str | None:
        """The attempt token: the path's ``/t/<token>`` wins over the ``Authorization: Bearer`` header."""
        path_token = request.path_params.get("token")
        if path_token:
            return str(path_token)
        auth = request.headers.get("authorization")
        if auth and auth[:7].lower() == "bearer ":
            return auth[7:].strip() or None
        return None

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

    # -- LLM calls -------------------------------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self._llm(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._llm(request, chat=False)

    async def _llm(self, request: Request, *, chat: bool) -> Response:
        state: AttemptState | None = None
        ctx: CallContext | None = None
        body: dict[str, Any] = {}
        started = now()
        try:
            raw = await self.read_json(request)
            body = validate_chat(raw) if chat else validate_completions(raw)
            state = await self.attempts.resolve(self.token_of(request))
            backend = self.backend_for(body["model"])
            if not chat and isinstance(backend, ExternalBackend):
                raise ProxyHTTPError(
                    400, f"model {body['model']!r} is external: use /v1/chat/completions", param="model"
                )
            seq = await state.take_seq(self.store)
            ctx = CallContext(
                attempt=state.attempt,
                call_id=new_id("call"),
                seq=seq,
                model=body["model"],
                policy_version=await self.policy_version(),
                _earlier=_earlier(state, self.store, seq),
            )
            state_now = state
            if body.get("stream"):
                if chat:
                    stream = backend.chat_stream(body, ctx)
                else:
                    assert not isinstance(backend, ExternalBackend)
                    stream = backend.completions_stream(body, ctx)
                first = await anext(stream)  # errors before the first byte still get a proper status code
                state.inflight += 1
                relay = self._relay(first, stream, state_now, ctx, body, chat, started)
                return StreamingResponse(relay, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            state.inflight += 1
            try:
                if chat:
                    result = await self._watch(request, backend.chat(body, ctx))
                else:
                    assert not isinstance(backend, ExternalBackend)
                    result = await self._watch(request, backend.completions(body, ctx))
            finally:
                state.inflight -= 1
        except ProxyHTTPError as err:
            return error_response(err)
        except UpstreamHTTPError as exc:
            self._record_error(state, ctx, body, chat, started, str(exc))
            return error_response(ProxyHTTPError(exc.status_code, str(exc)), exc.payload)
        except LightningSDKError as exc:
            self._record_error(state, ctx, body, chat, started, str(exc))
            return error_response(from_sdk_error(exc))
        except _ClientGone:
            self._record_error(state, ctx, body, chat, started, "the agent disconnected before the reply")
            return Response(status_code=499)
        await self._record(state, ctx, body, result, chat, started)
        return Response(orjson.dumps(result.response), media_type=_JSON)

    async def _watch(self, request: Request, coro: Any) -> ChatResult:
        """Await the backend; if the agent hangs up first, cancel it (which cancels the upstream request)."""
        task: asyncio.Future[ChatResult] = asyncio.ensure_future(coro)
        if not self.config.cancel_on_disconnect:
            return await task
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                raise _ClientGone()
            watcher.cancel()
        return task.result()

    async def _relay(
        self,
        first: StreamItem,
        stream: AsyncIterator[StreamItem],
        state: AttemptState,
        ctx: CallContext,
        body: dict[str, Any],
        chat: bool,
        started: float,
    ) -> AsyncIterator[bytes]:
        result: ChatResult | None = None
        error: str | None = "the agent disconnected mid-stream"
        try:
            item: StreamItem | None = first
            while item is not None:
                if isinstance(item, ChatResult):
                    result = item
                elif isinstance(item, bytes):
                    yield b"data: " + item + b"\n\n"
                else:
                    yield b"data: " + orjson.dumps(item) + b"\n\n"
                item = await anext(stream, None)
            error = None
            yield _SSE_DONE
        except LightningSDKError as exc:
            error = str(exc)
            err = from_sdk_error(exc)
            yield b"data: " + orjson.dumps({"error": {"message": err.message, "type": err.kind, "code": err.code}})
            yield b"\n\n" + _SSE_DONE
        finally:
            state.inflight -= 1
            if result is not None and error is None:
                self._record_nowait(state, ctx, body, result, chat, started)
            else:
                with contextlib.suppress(Exception):
                    await stream.aclose()  # type: ignore[attr-defined]
                self._record_error(state, ctx, body, chat, started, error or "stream ended without a result")

    # -- recording -------------------------------------------------------------------------------------------------
    def _make_call(
        self, ctx: CallContext, body: dict[str, Any], result: ChatResult | None, chat: bool, started: float
    ) -> Call:
        request = {k: v for k, v in body.items() if k not in _TRANSPORT_KEYS}
        if result is None:
            return Call(
                call_id=ctx.call_id,
                attempt_id=ctx.attempt.attempt_id,
                rollout_id=ctx.attempt.rollout_id,
                seq=ctx.seq,
                model=ctx.model,
                request=request,
                policy_version=ctx.policy_version,
                started_at=started,
                ended_at=now(),
                is_policy=self.external is None or not self.external.serves(ctx.model),
            )
        return Call(
            call_id=ctx.call_id,
            attempt_id=ctx.attempt.attempt_id,
            rollout_id=ctx.attempt.rollout_id,
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
            error=result.error,
        )

    async def _record(
        self,
        state: AttemptState | None,
        ctx: CallContext | None,
        body: dict[str, Any],
        result: ChatResult,
        chat: bool,
        started: float,
    ) -> None:
        if state is None or ctx is None:
            return
        call = self._make_call(ctx, body, result, chat, started)
        state.add_call(call)
        await self.recorder.add_call(call)

    def _record_nowait(
        self,
        state: AttemptState,
        ctx: CallContext,
        body: dict[str, Any],
        result: ChatResult | None,
        chat: bool,
        started: float,
        error: str | None = None,
    ) -> None:
        call = self._make_call(ctx, body, result, chat, started)
        if error is not None:
            call.error = error
        else:
            state.add_call(call)
        self.recorder.add_call_nowait(call)

    def _record_error(
        self,
        state: AttemptState | None,
        ctx: CallContext | None,
        body: dict[str, Any],
        chat: bool,
        started: float,
        error: str,
    ) -> None:
        if state is not None and ctx is not None:
            self._record_nowait(state, ctx, body, None, chat, started, error)

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

    async def health(self, request: Request) -> Response:
        return Response(orjson.dumps({"status": "ok", "pending_records": self.recorder.pending}), media_type=_JSON)

    # -- lifecycle -------------------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.recorder.start()
        try:
            yield
        finally:
            await self.recorder.stop()
            await self.backend.aclose()


def _earlier(state: AttemptState, store: Store, seq: int) -> Any:
    async def earlier() -> list[Call]:
        return await state.earlier_calls(store, seq)

    return earlier


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(
    store: Store,
    *,
    policy_backend: PolicyBackend,
    admin_key: str,
    external: list[ExternalRoute] | ExternalBackend | None = None,
    config: ProxyConfig | None = None,
    mount_store: bool = True,
) -> Starlette:
    """The proxy as an ASGI app. ``app.state.proxy`` is the ``Proxy`` (its ``recorder``, ``attempts``, ...)."""
    if not admin_key:
        raise ValueError("create_app: admin_key is required")
    if isinstance(external, list):
        external = ExternalBackend(external) if external else None
    proxy = Proxy(store, policy_backend, admin_key=admin_key, external=external, config=config)
    llm: list[BaseRoute] = [
        Route("/v1/chat/completions", proxy.chat, methods=["POST"]),
        Route("/v1/completions", proxy.completions, methods=["POST"]),
        Route("/v1/models", proxy.list_models, methods=["GET"]),
    ]
    routes: list[BaseRoute] = [
        *llm,
        Mount("/t/{token}", routes=[*llm, *admin_routes(proxy, token_routes_only=True)]),
        Route("/lightning/v1/health", proxy.health, methods=["GET"]),
        *admin_routes(proxy),
    ]
    if mount_store:
        from lightning_sdk.store.http_server import store_routes

        routes.append(Mount("/lightning/v1/store", routes=store_routes(store, admin_key)))
    app = Starlette(routes=routes, lifespan=proxy.lifespan, exception_handlers={404: _not_found, 405: _not_allowed})
    app.state.proxy = proxy
    return app


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(ProxyHTTPError(404, f"no route {request.method} {request.url.path}"))


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(ProxyHTTPError(405, f"method {request.method} not allowed on {request.url.path}"))
