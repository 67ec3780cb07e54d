"""The two attempt-token endpoints a worker calls on the proxy/daemon: ``reward`` and ``finish``.

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
from lightning_sdk.errors import AttemptNotRunningError, AuthError, LightningSDKError, StoreUnavailableError

__all__ = ["ServerClient"]

logger = logging.getLogger(__name__)


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, httpx.TransportError | TransientAnswer)


class ServerClient:
    """Posts rewards and finishes attempts at ``server_url`` (the proxy root, without ``/v1``)."""

    def __init__(self, server_url: str, *, http: httpx.AsyncClient | None = None, retries: int = 5) -> None:
        self.server_url = server_url.rstrip("/")
        self._http = http or httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=10.0))
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

    async def _post(self, path: str, token: str, body: dict[str, Any]) -> None:
        url = f"{self.server_url}{path}"

        async def one_try() -> httpx.Response:
            resp = await self._http.post(url, json=body, headers={"Authorization": f"Bearer {token}"})
            if resp.status_code >= 500:
                raise TransientAnswer(resp, f"HTTP {resp.status_code}")
            return resp

        try:
            resp = await retry(one_try, policy=self._retry, retry_if=_retryable, what=f"POST {url}")
        except httpx.TransportError as exc:
            raise StoreUnavailableError(f"POST {url} failed after {self._retry.retries + 1} tries: {exc!r}") from exc
        except TransientAnswer as exc:
            resp = exc.answer
        if resp.status_code < 300:
            return
        detail = resp.text[:500]
        if resp.status_code == 401:
            raise AuthError(f"POST {url}: unknown attempt token ({detail})")
        if resp.status_code == 409:
            raise AttemptNotRunningError(f"POST {url}: the attempt is no longer running ({detail})")
        raise LightningSDKError(f"POST {url} answered {resp.status_code}: {detail}")

    async def close(self) -> None:
        if self._owns_http:
            await self._http.aclose()
