"""``HTTPStore``: the ``Store`` protocol spoken to a store served by ``store_routes`` (daemon or proxy).

Retries. A request that never reached the server (connection refused, connect timeout) is retried for every
operation; so is a 5xx answer, because the server rolls back the operation's transaction before answering with an
error. A request that may have reached the server but got no answer (read error, read timeout) is retried only for
operations that are safe to repeat: everything except ``open_session`` and ``claim`` (a blind retry of those could
take a second rollout). ``enqueue`` is made safe by naming the groups on the client. ``finish_attempt`` retried
after a lost answer may find its own earlier finish and answers it instead of a 409. 4xx answers are never retried.
Backoff and the one-level rule are ``lightning_sdk._retry``'s (exponential from ``backoff_s``, capped at 5 s, with
jitter). Errors come back as the same exception classes the server raised (``NotFoundError``,
``InvalidTransitionError``, ``ConfigError``, ...); a server that stays unreachable raises ``StoreUnavailableError``.
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

import httpx
import orjson
from pydantic import BaseModel, ValidationError

from lightning_sdk._retry import RetryPolicy, TransientAnswer, retry
from lightning_sdk.errors import StoreError, StoreUnavailableError
from lightning_sdk.store import _wire as w
from lightning_sdk.store._events import AttemptEnds
from lightning_sdk.types import (
    Attempt,
    AttemptStatus,
    Call,
    Claim,
    FinishedGroup,
    Group,
    PolicyVersion,
    Resource,
    Reward,
    Rollout,
    RolloutDetail,
    RolloutStatus,
    Task,
    new_id,
)

__all__ = ["HTTPStore"]

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, httpx.TransportError | TransientAnswer)


class HTTPStore:
    """A ``Store`` whose every operation is one HTTP request to ``base_url`` (e.g. ``http://host:4700/lightning/v1/store``)."""

    #: attempts end in the server's process: nothing here to wait on (the trainer polls)
    attempt_ends: AttemptEnds | None = None

    def __init__(
        self,
        base_url: str,
        admin_key: str,
        *,
        timeout: float = 30.0,
        retries: int = 5,
        backoff_s: float = 0.1,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retry_policy = RetryPolicy(retries=retries, backoff_s=backoff_s)
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers={"authorization": f"Bearer {admin_key}", "content-type": "application/json"},
            timeout=httpx.Timeout(timeout),
            transport=transport,
        )

    async def _send(
        self, method: str, path: str, body: BaseModel | None, params: dict[str, Any] | None, repeatable: bool
    ) -> tuple[httpx.Response, bool]:
        """One request with retries: the final answer, and whether an earlier try may have reached the server."""
        content = w.dump(body) if body is not None else None
        clean = {k: v for k, v in (params or {}).items() if v is not None}
        maybe_sent = False

        async def one_try() -> httpx.Response:
            nonlocal maybe_sent
            try:
                resp = await self._client.request(method, path, content=content, params=clean)
            except _NOT_SENT:
                raise
            except httpx.TransportError as exc:
                if not repeatable:  # it may have reached the server: never repeated
                    raise StoreUnavailableError(f"store at {self.base_url}: {method} {path} failed: {exc!r}") from exc
                maybe_sent = True
                raise
            if resp.status_code >= 500:
                raise TransientAnswer(resp, f"HTTP {resp.status_code}")
            return resp

        try:
            resp = await retry(one_try, policy=self.retry_policy, retry_if=_retryable, what=f"store {method} {path}")
        except TransientAnswer as exc:  # still failing after the last try: the caller reads the error body
            return exc.answer, maybe_sent
        except _NOT_SENT as exc:
            raise StoreUnavailableError(f"store at {self.base_url} unreachable: {exc!r}") from exc
        except httpx.TransportError as exc:
            raise StoreUnavailableError(f"store at {self.base_url}: {method} {path} failed: {exc!r}") from exc
        return resp, maybe_sent

    def _parse(self, resp: httpx.Response, out: type[M]) -> M:
        if resp.status_code >= 400:
            raise w.error_from(resp.status_code, resp.content)
        try:
            return out.model_validate(orjson.loads(resp.content))
        except (orjson.JSONDecodeError, ValidationError) as exc:
            raise StoreError(
                f"store at {self.base_url} sent a malformed answer to {resp.request.url.path}: {exc}"
            ) from exc

    async def _call(
        self,
        method: str,
        path: str,
        out: type[M],
        body: BaseModel | None = None,
        *,
        params: dict[str, Any] | None = None,
        repeatable: bool = True,
    ) -> M:
        resp, _ = await self._send(method, path, body, params, repeatable)
        return self._parse(resp, out)

    # -- tasks, groups, rollouts ---------------------------------------------------------------------------------
    async def enqueue(
        self,
        tasks: list[Task],
        *,
        n: int = 1,
        max_attempts: int = 1,
        split: str = "train",
        group_ids: list[str] | None = None,
    ) -> list[Group]:
        ids = group_ids if group_ids is not None else [new_id("gr") for _ in tasks]  # makes retries idempotent
        per_request = max(1, w.MAX_ENQUEUE_ROLLOUTS // max(1, n))  # the server bounds rollouts per request
        groups: list[Group] = []
        for i in range(0, max(1, len(tasks)), per_request):
            req = w.EnqueueRequest(
                tasks=tasks[i : i + per_request],
                n=n,
                max_attempts=max_attempts,
                split=split,
                group_ids=ids[i : i + per_request],
            )
            groups += (await self._call("POST", "/enqueue", w.GroupsBody, req)).groups
        return groups

    async def open_session(
        self, task: Task | None = None, group_id: str | None = None, *, split: str = "train"
    ) -> Claim:
        req = w.OpenSessionRequest(task=task, group_id=group_id, split=split)
        res = await self._call("POST", "/sessions", w.ClaimBody, req, repeatable=False)
        if res.claim is None:
            raise StoreError("store answered an empty session")
        return res.claim

    async def claim(self, worker_id: str, *, lease_s: float = 60.0, split: str | None = None) -> Claim | None:
        req = w.ClaimRequest(worker_id=worker_id, lease_s=lease_s, split=split)
        res = await self._call("POST", "/claim", w.ClaimBody, req, repeatable=False)
        return res.claim

    async def heartbeat(self, attempt_id: str, *, lease_s: float = 60.0) -> Attempt:
        req = w.HeartbeatRequest(lease_s=lease_s)
        res = await self._call("POST", f"/attempts/{attempt_id}/heartbeat", w.AttemptBody, req)
        return res.attempt

    async def finish_attempt(self, attempt_id: str, status: AttemptStatus, error: str | None = None) -> Attempt:
        req = w.FinishRequest(status=AttemptStatus(status), error=error)
        resp, maybe_sent = await self._send("POST", f"/attempts/{attempt_id}/finish", req, None, True)
        if maybe_sent and resp.status_code == 409:
            # A retry after a lost answer finds the attempt ended: if it ended the way we asked, that was our try.
            current = await self.get_attempt(attempt_id)
            if current.status is AttemptStatus(status) and current.error == error:
                return current
        return self._parse(resp, w.AttemptBody).attempt

    async def expire_leases(self) -> list[Attempt]:
        res = await self._call("POST", "/leases/expire", w.AttemptsBody)
        return res.attempts

    async def cancel_rollout(self, rollout_id: str) -> Rollout:
        res = await self._call("POST", f"/rollouts/{rollout_id}/cancel", w.RolloutBody)
        return res.rollout

    async def get_attempt(self, attempt_id: str) -> Attempt:
        res = await self._call("GET", f"/attempts/{attempt_id}", w.AttemptBody)
        return res.attempt

    # -- calls and rewards ---------------------------------------------------------------------------------------
    async def attempt_by_token(self, token: str) -> Attempt | None:
        res = await self._call("POST", "/tokens/lookup", w.MaybeAttemptBody, w.TokenRequest(token=token))
        return res.attempt

    async def record_calls(self, calls: list[Call]) -> None:
        if calls:
            await self._call("POST", "/calls", w.OkBody, w.CallsBody(calls=calls))

    async def record_rewards(self, rewards: list[Reward]) -> None:
        if rewards:
            await self._call("POST", "/rewards", w.OkBody, w.RewardsBody(rewards=rewards))

    # -- reading -------------------------------------------------------------------------------------------------
    async def get_rollout(self, rollout_id: str) -> RolloutDetail:
        res = await self._call("GET", f"/rollouts/{rollout_id}", w.RolloutDetailBody)
        return res.detail

    async def list_rollouts(
        self, *, status: RolloutStatus | None = None, limit: int = 100, after: str | None = None
    ) -> tuple[list[Rollout], str | None]:
        params = {"status": RolloutStatus(status).value if status is not None else None, "limit": limit, "after": after}
        res = await self._call("GET", "/rollouts", w.RolloutPageBody, params=params)
        return res.rollouts, res.next

    async def list_rollout_details(
        self, *, limit: int = 100, after: str | None = None
    ) -> tuple[list[RolloutDetail], str | None]:
        res = await self._call(
            "GET", "/rollout-details", w.RolloutDetailPageBody, params={"limit": limit, "after": after}
        )
        return res.details, res.next

    async def list_group_details(
        self, *, split: str | None = None, limit: int = 64, after: str | None = None
    ) -> tuple[list[FinishedGroup], str | None]:
        params = {"limit": limit, "after": after, "split": split}
        res = await self._call("GET", "/group-details", w.GroupDetailPageBody, params=params)
        return [FinishedGroup(g.group, g.rollouts) for g in res.groups], res.next

    async def counts(self) -> dict[str, int]:
        res = await self._call("GET", "/counts", w.CountsBody)
        return res.counts

    # -- training ------------------------------------------------------------------------------------------------
    async def finished_groups(self, *, limit: int = 64, split: str = "train") -> list[FinishedGroup]:
        params = {"limit": limit, "split": split}
        res = await self._call("GET", "/groups/finished", w.FinishedGroupsBody, params=params)
        return [FinishedGroup(g.group, g.rollouts) for g in res.groups]

    async def consume_groups(self, step: int, group_ids: list[str]) -> list[str]:
        req = w.ConsumeRequest(step=step, group_ids=group_ids)
        res = await self._call("POST", "/groups/consume", w.ConsumeBody, req)
        return res.consumed

    async def publish_version(self, version: PolicyVersion) -> None:
        await self._call("POST", "/versions", w.OkBody, version)

    async def current_version(self) -> PolicyVersion | None:
        res = await self._call("GET", "/versions/current", w.VersionBody)
        return res.version

    async def set_resource(self, resource: Resource) -> None:
        await self._call("PUT", "/resources", w.OkBody, resource)

    async def get_resources(self) -> list[Resource]:
        res = await self._call("GET", "/resources", w.ResourcesBody)
        return res.resources

    async def set_meta(self, key: str, value: Any) -> None:
        await self._call("PUT", f"/meta/{key}", w.OkBody, w.MetaBody(value=value))

    async def get_meta(self, key: str) -> Any | None:
        res = await self._call("GET", f"/meta/{key}", w.MetaBody)
        return res.value

    async def close(self) -> None:
        await self._client.aclose()
