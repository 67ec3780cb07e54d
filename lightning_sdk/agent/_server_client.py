"""The attempt-token endpoints a worker calls on the proxy/daemon: ``reward``, ``finish`` and ``calls``.

``finish`` is the durability barrier: the server answers only after every call and reward of the attempt is
committed, so the worker always ends an attempt through it (never by writing the store behind the proxy's back,
which could race the proxy's own writes). Connection failures and 5xx answers are retried (``lightning_sdk._retry``);
HTTP errors are translated into ``lightning_sdk.errors``.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx

from lightning_sdk._retry import RetryPolicy, TransientAnswer, retry
from lightning_sdk.agent._transport import Http1Transport
from lightning_sdk.errors import AttemptNotRunningError, AuthError, LightningSDKError, StoreUnavailableError
from lightning_sdk.types import Call

__all__ = ["ServerClient"]

logger = logging.getLogger(__name__)


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, httpx.TransportError | TransientAnswer)


class ServerClient:
    """Posts rewards and finishes attempts at ``server_url`` (the proxy root, without ``/v1``)."""

    def __init__(self, server_url: str, *, http: httpx.AsyncClient | None = None, retries: int = 5) -> None:
        self.server_url = server_url.rstrip("/")
        self._http = http or httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=10.0), transport=Http1Transport())
        self._owns_http = http is None
        self._retry = RetryPolicy(retries=retries, backoff_s=0.2)

    async def reward(self, token: str, value: float, name: str = "reward", call_id: str | None = None) -> None:
        body: dict[str, Any] = {"value": value, "name": name}
        if call_id is not None:
            body["call_id"] = call_id
        await self._post("/lightning/v1/reward", token, body)

    async def finish(self, token: str, status: str, error: str | None = None) -> None:
        body: dict[str, Any] = {"status": status}
        if error is not None:
            body["error"] = error
        await self._post("/lightning/v1/finish", token, body)

    async def calls(self, token: str) -> list[Call]:
        """The attempt's answered calls in order (``GET /lightning/v1/calls``, once its requests in flight are done)."""
        resp = await self._send("GET", "/lightning/v1/calls", token, None)
        try:
            data = resp.json()
            calls = [Call.model_validate(c) for c in data["calls"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise LightningSDKError(f"GET {self.server_url}/lightning/v1/calls: unexpected answer ({exc})") from exc
        if data.get("inflight"):
            logger.warning(
                "attempt %s: %s requests in flight are not among its calls", data.get("attempt_id"), data["inflight"]
            )
        return sorted(calls, key=lambda c: c.seq)

    async def _post(self, path: str, token: str, body: dict[str, Any]) -> None:
        await self._send("POST", path, token, body)

    async def _send(self, method: str, path: str, token: str, body: dict[str, Any] | None) -> httpx.Response:
        url = f"{self.server_url}{path}"

        async def one_try() -> httpx.Response:
            resp = await self._http.request(method, url, json=body, headers={"Authorization": f"Bearer {token}"})
            if resp.status_code >= 500:
                raise TransientAnswer(resp, f"HTTP {resp.status_code}")
            return resp

        try:
            resp = await retry(one_try, policy=self._retry, retry_if=_retryable, what=f"{method} {url}")
        except httpx.TransportError as exc:
            raise StoreUnavailableError(
                f"{method} {url} failed after {self._retry.retries + 1} tries: {exc!r}"
            ) from exc
        except TransientAnswer as exc:
            resp = exc.answer
        if resp.status_code < 300:
            return resp
        detail = resp.text[:500]
        if resp.status_code == 401:
            raise AuthError(f"{method} {url}: unknown attempt token ({detail})")
        if resp.status_code == 409:
            raise AttemptNotRunningError(f"{method} {url}: the attempt is no longer running ({detail})")
        raise LightningSDKError(f"{method} {url} answered {resp.status_code}: {detail}")

    async def close(self) -> None:
        if self._owns_http:
            await self._http.aclose()
