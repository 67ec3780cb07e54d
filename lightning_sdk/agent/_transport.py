"""An httpx transport on the proxy's pooled HTTP/1.1 client: what agents and workers send to the proxy, cheaply.

httpx's own transport (httpcore) costs far more CPU per request than anything else an in-process agent worker does:
measured on this 2-core machine against a trivial loopback server, ~750 us of client CPU a request one at a time and
~2,000 us at concurrency 64 (httpcore walks every pooled connection, polling its socket, on each request; aiohttp
~100-140 us, ``http1.py``'s pool 22-37 us). In the main job 64 workers make every LLM call and every reward
and finish through httpx: that was ~40% of the event loop's CPU, on the two cores the engine and the learner need.

``Http1Transport`` keeps httpx's API (``httpx.AsyncClient(transport=Http1Transport())``, and so any SDK built on
httpx: ``openai.AsyncOpenAI(http_client=...)``) and sends plain-HTTP requests over ``Http1Pool`` keep-alive
connections, one pool per origin and timeout. Responses stream (server-sent events arrive as they come), are
decoded by httpx as usual (gzip ...), and errors are httpx's (``ConnectError``, ``ReadTimeout``,
``RemoteProtocolError``), so retry logic built on httpx keeps working. What it does not do goes to httpx's own
transport, unchanged: ``https``, ``HEAD``, origins an environment proxy (``HTTP_PROXY``, ``ALL_PROXY``) applies to.
"""

from __future__ import annotations

import asyncio
import sys
import urllib.request
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx

from lightning_sdk.http1 import (
    Http1ConnectError,
    Http1Error,
    Http1Pool,
    Http1ReadTimeout,
    Http1Response,
)

__all__ = ["Http1Transport", "openai_http_client"]

_DROPPED = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive"})
_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE"})


def _transport_class(hx: Any) -> Any:
    """The transport class for the httpx-like module ``hx`` (``httpx``, or ``httpx2``, which the OpenAI SDK uses)."""

    def httpx_error(exc: Http1Error, request: Any) -> Exception:
        if isinstance(exc, Http1ConnectError):
            return hx.ConnectError(str(exc), request=request)  # type: ignore[no-any-return]
        if isinstance(exc, Http1ReadTimeout):
            return hx.ReadTimeout(str(exc), request=request)  # type: ignore[no-any-return]
        return hx.RemoteProtocolError(str(exc), request=request)  # type: ignore[no-any-return]

    class Body(hx.AsyncByteStream):  # type: ignore[misc]
        """A response body read from its ``Http1Response`` as it arrives; closing it early drops the connection."""

        def __init__(self, resp: Http1Response, request: Any) -> None:
            self._resp = resp
            self._request = request

        async def __aiter__(self) -> AsyncIterator[bytes]:
            try:
                async for chunk in self._resp.iter_bytes():
                    yield chunk
            except Http1Error as exc:
                raise httpx_error(exc, self._request) from exc

        async def aclose(self) -> None:
            self._resp.close()  # a no-op once the body was read to the end (the connection went back to the pool)

    class Transport(hx.AsyncBaseTransport):  # type: ignore[misc]
        """The transport for plain-HTTP origins on ``Http1Pool`` (see the module docstring)."""

        def __init__(self) -> None:
            self._pools: dict[tuple[str, int, float, float], Http1Pool] = {}
            self._proxy_of: dict[tuple[str, str], str | None] = {}
            self._loop: asyncio.AbstractEventLoop | None = None
            self._fallbacks: dict[str | None, Any] = {}

        def _env_proxy(self, scheme: str, host: str) -> str | None:
            """The environment proxy for ``scheme`` requests to ``host`` (``HTTP_PROXY``/``HTTPS_PROXY``/
            ``ALL_PROXY``, unless ``NO_PROXY`` exempts it: what httpx applies when it builds its own transport),
            looked up once per origin."""
            key = (scheme, host)
            if key not in self._proxy_of:
                proxies = urllib.request.getproxies_environment()
                proxy = proxies.get(scheme) or proxies.get("all")
                if proxy and _bypassed(host, proxies):
                    proxy = None
                self._proxy_of[key] = proxy or None
            return self._proxy_of[key]

        def _fallback(self, proxy: str | None) -> Any:
            transport = self._fallbacks.get(proxy)
            if transport is None:
                transport = self._fallbacks[proxy] = hx.AsyncHTTPTransport(proxy=proxy)
            return transport

        def _pool(self, host: str, port: int, timeouts: dict[str, Any]) -> Http1Pool:
            loop = asyncio.get_running_loop()
            if loop is not self._loop:  # pools belong to the loop that opened their connections
                self._pools, self._loop = {}, loop
            connect = timeouts.get("connect")
            read = timeouts.get("read")
            key = (host, port, -1.0 if connect is None else float(connect), -1.0 if read is None else float(read))
            pool = self._pools.get(key)
            if pool is None:
                pool = Http1Pool(
                    f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}",
                    connect_timeout=1e9 if connect is None else float(connect),
                    read_timeout=1e9 if read is None else float(read),
                )
                self._pools[key] = pool
            return pool

        async def handle_async_request(self, request: Any) -> Any:
            url = request.url
            proxy = self._env_proxy(url.scheme, url.host)
            if url.scheme != "http" or request.method not in _METHODS or proxy is not None:
                return await self._fallback(proxy).handle_async_request(request)
            body = await request.aread()
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROPPED}
            if request.method == "POST" and "idempotency-key" not in request.headers:
                headers["idempotency-key"] = new_idempotency_key()
            pool = self._pool(url.host, url.port or 80, request.extensions.get("timeout") or {})
            try:
                resp = await pool.send(request.method, url.raw_path.decode("ascii"), body, headers)
            except Http1Error as exc:
                raise httpx_error(exc, request) from exc
            return hx.Response(
                resp.status,
                headers=resp.headers,
                stream=Body(resp, request),
                request=request,
                extensions={"http_version": b"HTTP/1.1"},
            )

        async def aclose(self) -> None:
            pools, self._pools = self._pools, {}
            for pool in pools.values():
                await pool.aclose()
            fallbacks, self._fallbacks = self._fallbacks, {}
            for transport in fallbacks.values():
                await transport.aclose()

    return Transport


def new_idempotency_key() -> str:
    """A key for one logical call (``Idempotency-Key``), for a request that came without one."""
    return uuid.uuid4().hex


def _bypassed(host: str, proxies: dict[str, str]) -> bool:
    bypass = getattr(urllib.request, "proxy_bypass_environment", None)  # not in typeshed; in every CPython
    return bool(bypass(host, proxies)) if bypass is not None else False


Http1Transport: type[httpx.AsyncBaseTransport] = _transport_class(httpx)
"""``httpx.AsyncClient(transport=Http1Transport())``: plain-HTTP requests on ``Http1Pool`` (module docstring)."""


def openai_http_client(base_urls: tuple[str, ...] = ()) -> Any:
    """An HTTP client for ``openai.AsyncOpenAI(http_client=...)`` with its requests on ``Http1Pool``: the SDK's
    default client (its timeouts and limits) over ``Http1Transport`` built for the httpx the SDK uses (``httpx2``
    for openai 3, ``httpx`` before). ``base_urls`` (two or more): fail over between them (``_failover_class``)."""
    import openai

    base = openai.DefaultAsyncHttpxClient
    hx = sys.modules[next(c for c in base.__mro__ if c.__name__ == "AsyncClient").__module__.split(".")[0]]
    transport = _transport_for(hx)()
    if len(base_urls) > 1:
        transport = _failover_class(hx)(transport, base_urls)
    return base(transport=transport)


def _failover_class(hx: Any) -> Any:
    """A transport over several base URLs of proxies that share one store (docs/scale-out.md): a request to one of
    them that fails to connect or is cut off before its answer (the proxy died) is sent to the next, and the one
    that answered is tried first from then on. Only connection failures move on: an HTTP error answer is returned.
    A call a dead proxy had committed but not answered is made again on the next with the same ``Idempotency-Key``
    (one is added when the request has none), so the store keeps one record of it (``Call.idempotency_key``)."""
    moving_on = (hx.ConnectError, hx.RemoteProtocolError, hx.ReadError, hx.WriteError)

    class FailoverTransport(hx.AsyncBaseTransport):  # type: ignore[misc]
        def __init__(self, inner: Any, base_urls: tuple[str, ...]) -> None:
            self.inner = inner
            self.bases = [u.rstrip("/") for u in base_urls]
            self.current = 0

        async def handle_async_request(self, request: Any) -> Any:
            url = str(request.url)
            origin = next((b for b in self.bases if url.startswith(b)), None)
            if origin is None:
                return await self.inner.handle_async_request(request)
            rest = url[len(origin) :]
            body = request.content  # already read: the SDK sends bytes
            headers = [(k, v) for k, v in request.headers.raw if k.lower() != b"host"]
            if request.method == "POST" and "idempotency-key" not in request.headers:
                headers.append((b"idempotency-key", new_idempotency_key().encode()))  # the same on every proxy
            last: BaseException | None = None
            for k in range(len(self.bases)):
                i = (self.current + k) % len(self.bases)
                req = hx.Request(request.method, self.bases[i] + rest, headers=headers, content=body,
                                 extensions=request.extensions)  # fmt: skip
                try:
                    response = await self.inner.handle_async_request(req)
                except moving_on as exc:
                    last = exc
                    continue
                self.current = i
                return response
            assert last is not None
            raise last

        async def aclose(self) -> None:
            await self.inner.aclose()

    return FailoverTransport


_classes: dict[str, Any] = {"httpx": Http1Transport}


def _transport_for(hx: Any) -> Any:
    cls = _classes.get(hx.__name__)
    if cls is None:
        cls = _classes[hx.__name__] = _transport_class(hx)
    return cls
