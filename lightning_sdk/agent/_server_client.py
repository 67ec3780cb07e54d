"""The two attempt-token endpoints a worker calls on the proxy/daemon: ``reward`` and ``finish``.

``finish`` is the durability barrier: the server answers only after every call and reward of the attempt is
committed, so the worker always ends an attempt through it (never by writing the store behind the proxy's back,
which could race the proxy's own writes). Connection failures are retried with backoff; HTTP errors are
translated into ``lightning_sdk.errors``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from lightning_sdk.errors import AttemptNotRunningError, AuthError, LightningSDKError, StoreUnavailableError

__all__ = ["ServerClient"]

logger = logging.getLogger(__name__)


class ServerClient:
    """Posts rewards and finishes attempts at ``server_url`` (the proxy root, without ``/v1``)."""

    def __init__(self, server_url: str, *, http: httpx.AsyncClient | None = None, retries: int = 5) -> None:
        self.server_url = server_url.rstrip("/")
        self._http = http or httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=10.0))
        self._owns_http = http is None
        self._retries = retries

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
        delay = 0.2
        for attempt in range(self._retries + 1):
            try:
                resp = await self._http.post(url, json=body, headers={"Authorization": f"Bearer {token}"})
            except httpx.TransportError as exc:
                if attempt == self._retries:
                    raise StoreUnavailableError(f"POST {url} failed after {attempt + 1} tries: {exc!r}") from exc
                logger.warning("POST %s failed (%r); retrying in %.1f s", url, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            if resp.status_code < 300:
                return
            detail = resp.text[:500]
            if resp.status_code == 401:
                raise AuthError(f"POST {url}: unknown attempt token ({detail})")
            if resp.status_code == 409:
                raise AttemptNotRunningError(f"POST {url}: the attempt is no longer running ({detail})")
            if resp.status_code >= 500 and attempt < self._retries:
                logger.warning("POST %s answered %s; retrying in %.1f s", url, resp.status_code, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            raise LightningSDKError(f"POST {url} answered {resp.status_code}: {detail}")

    async def close(self) -> None:
        if self._owns_http:
            await self._http.aclose()
