"""The tracing proxy: an ASGI app (starlette) that serves the OpenAI API to agents and records every call.

Routes (the HTTP contract in docs/concepts.md / ARCHITECTURE.md)::

    POST /v1/chat/completions, POST /v1/completions, GET /v1/models     (also under /t/<attempt token>/v1/...)
    POST /v1/responses, POST /v1/messages[/count_tokens]                (proxy/surfaces: translated to the chat form)
    POST /lightning/v1/reward, POST /lightning/v1/finish                (attempt token)
    POST /lightning/v1/sessions, GET /lightning/v1/rollouts[/{id}]      (admin key)
    GET  /lightning/v1/health                                           (no key)
    GET  /metrics                                                       (no key: Prometheus, lightning_sdk.monitoring)
    /lightning/v1/store/...                                             (the store over HTTP, admin key)

This module is the routing and the lifespan. One routing table: the LLM routes (``llm_routes``: path -> the
call pipeline of ``proxy/_call.py`` with that API's adapter, or count_tokens) are dispatched by ``ProxyApp`` on the
raw ASGI path (the hot path: no starlette routing, no request object), with or without a ``/t/<token>`` prefix; any
other method on them is 405. Every other route is starlette's, whose body ``ProxyApp`` reads first within its
limit. Errors of the starlette routes are answered by the exception handlers registered once in ``create_app``
(the library's exceptions by the one table of ``lightning_sdk.http_errors``, 404 and 405 in the OpenAI shape); the
LLM routes answer theirs in each API's own shape (``proxy/_call.py``). The proxy's state (store, backends, recorder,
attempts, the finish barrier) is ``proxy/_service.py``'s ``Proxy``; observers (``proxy/observe.py``) see every call.

One LLM call (``proxy/_call.py``): read the body (413 over ``max_body_bytes``), parse and validate it (400 naming the
field), resolve the attempt from the token (path token wins over the bearer; 401 unknown, 409 not running), pick
the backend by model name (the policy backend, or LiteLLM for an external route), call it, answer the agent, and
hand the call to the ``Recorder`` that commits it in the background. Every response of a call the proxy opened
carries the header ``X-Lightning-Call-Id: <call_id>`` (streamed or not, errors too), so an agent can give that call
a per-call reward (``POST /lightning/v1/reward {"call_id": ...}``). ``finish`` waits for the attempt's calls in
flight, flushes its records, then ends the attempt: a finished attempt's calls are committed before the answer.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.types import Receive, Scope, Send

from lightning_sdk.errors import ConfigError, LightningSDKError
from lightning_sdk.http_errors import error_headers
from lightning_sdk.monitoring import OpsMetrics, metrics_route
from lightning_sdk.proxy._admin import admin_routes
from lightning_sdk.proxy._backend import PolicyBackend
from lightning_sdk.proxy._call import (
    ABORTED,
    CALL_ID_HEADER,
    CHAT_COMPLETIONS,
    COMPLETIONS,
    Adapter,
    receive_within,
    serve_call,
)
from lightning_sdk.proxy._errors import ProxyHTTPError, error_response, from_sdk_error
from lightning_sdk.proxy._external import ExternalBackend, ExternalRoute
from lightning_sdk.proxy._service import Proxy, ProxyConfig
from lightning_sdk.proxy.observe import CallObserver
from lightning_sdk.proxy.surfaces import COUNT_TOKENS_PATH, SURFACES, count_tokens
from lightning_sdk.store.base import Store

__all__ = ["ABORTED", "CALL_ID_HEADER", "LLMRoute", "Proxy", "ProxyApp", "ProxyConfig", "create_app", "llm_routes"]

logger = logging.getLogger(__name__)

LLMHandler = Callable[[Scope, Receive, Send, "str | None"], Awaitable[None]]
"""An LLM route's handler: ``(scope, receive, send, path token or None)``."""


class LLMRoute:
    """One LLM route: the call pipeline with ``adapter`` (``route`` / ``token_route``: the path as observers see
    it), or another ``handler`` (count_tokens: nothing is generated or recorded)."""

    __slots__ = ("adapter", "handler", "route", "token_route")

    def __init__(self, path: str, adapter: Adapter | None = None, handler: LLMHandler | None = None) -> None:
        self.adapter = adapter
        self.handler = handler
        self.route = path
        self.token_route = "/t/{token}" + path


def llm_routes(proxy: Proxy) -> dict[str, LLMRoute]:
    """The routing table of the LLM routes (POST; each also under ``/t/<token>``): a new API surface is one line
    here (or in ``surfaces.SURFACES``) and one adapter module (``proxy/surfaces``)."""

    async def count(scope: Scope, receive: Receive, send: Send, token: str | None) -> None:
        await count_tokens(proxy, scope, receive, send, token)

    table = {
        "/v1/chat/completions": LLMRoute("/v1/chat/completions", CHAT_COMPLETIONS),
        "/v1/completions": LLMRoute("/v1/completions", COMPLETIONS),
    }
    for path, adapter in SURFACES.items():  # the Responses and Messages APIs
        table[path] = LLMRoute(path, adapter)
    table[COUNT_TOKENS_PATH] = LLMRoute(COUNT_TOKENS_PATH, handler=count)
    return table


def _error_start(err: ProxyHTTPError) -> dict[str, Any]:
    body = orjson.dumps(err.body())
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return {"type": "http.response.start", "status": err.status, "headers": headers + error_headers(err.status)}


class ProxyApp:
    """The proxy's ASGI app: the LLM routes (``llm``, see ``llm_routes``) are dispatched directly, everything
    else goes to the starlette app.

    ``state.proxy`` is the ``Proxy``; ``starlette`` the app behind (add routes with ``extra_routes`` in
    ``create_app``).
    """

    def __init__(self, proxy: Proxy, starlette: Starlette) -> None:
        self.proxy = proxy
        self.starlette = starlette
        self.state = starlette.state
        self.llm = llm_routes(proxy)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path: str = scope["path"]
            token: str | None = None
            if path.startswith("/t/"):
                token, _, rest = path[3:].partition("/")
                path = "/" + rest
            llm = self.llm.get(path)
            if llm is not None:
                if scope["method"] == "POST":
                    token = token or None
                    if llm.adapter is not None:
                        route = llm.route if token is None else llm.token_route
                        return await serve_call(self.proxy, llm.adapter, route, scope, receive, send, token)
                    assert llm.handler is not None
                    return await llm.handler(scope, receive, send, token)
                err = ProxyHTTPError(405, f"method {scope['method']} not allowed on {scope['path']}")
                await send(_error_start(err))
                await send({"type": "http.response.body", "body": orjson.dumps(err.body())})
                return
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
                    message = await receive_within(receive, config.read_timeout_s)
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
            await send(_error_start(err))
            await send({"type": "http.response.body", "body": orjson.dumps(err.body())})
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
    observers: Sequence[CallObserver] = (),
    metrics: OpsMetrics | None = None,
) -> ProxyApp:
    """The proxy as an ASGI app (``app.state.proxy`` is the ``Proxy``: its ``recorder``, ``attempts``, ...).

    ``external`` routes model names to providers through LiteLLM; ``mount_store`` serves the store's HTTP API at
    ``/lightning/v1/store`` (admin key); ``extra_routes`` are added to the app (e.g. the daemon's task queue);
    ``close_store`` closes the store when the app shuts down (after the last records are written);
    ``observers`` watch every call, reward and finish (``proxy/observe.py``); ``metrics`` is what ``GET /metrics``
    serves (a new ``OpsMetrics`` on its own registry when not given; none when ``config.metrics`` is false and none
    is given).
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
        observers=observers,
        metrics=metrics,
    )
    llm: list[BaseRoute] = [  # the POST routes are ProxyApp's (llm_routes)
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
    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        LightningSDKError: _sdk_error,
        404: _not_found,
        405: _not_allowed,
    }
    app = Starlette(routes=routes, lifespan=_lifespan(proxy), exception_handlers=handlers)
    app.state.proxy = proxy
    return ProxyApp(proxy, app)


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(ProxyHTTPError(404, f"no route {request.method} {request.url.path}"))


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(ProxyHTTPError(405, f"method {request.method} not allowed on {request.url.path}"))


async def _sdk_error(request: Request, exc: Exception) -> Response:
    """Every starlette route's library exception, by the one table (a ``ProxyHTTPError`` answers as it is)."""
    assert isinstance(exc, LightningSDKError)
    return error_response(from_sdk_error(exc))


def _lifespan(proxy: Proxy) -> Callable[[Starlette], contextlib.AbstractAsyncContextManager[None]]:
    """Start the recorder and the backend; at shutdown flush the records, close the backend (and the store)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        proxy.recorder.start()
        if proxy.commits is not None:
            proxy.commits.start()
        await proxy.backend.start()  # e.g. the passthrough's watch for an upstream that is not up yet
        try:
            yield
        finally:
            await proxy.recorder.stop()
            if proxy.commits is not None:
                await proxy.commits.stop()
            await proxy.backend.aclose()
            if proxy.close_store:
                await proxy.store.close()

    return lifespan
