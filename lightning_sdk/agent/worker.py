"""Agent workers: claim attempts from the store, run the agent on them concurrently, finish them through the proxy.

One ``WorkerPool`` runs up to ``n_workers`` attempts at once on the caller's event loop — async agents as asyncio
tasks, sync agents on threads, command agents as subprocesses (the agent decides, see ``Agent.run_attempt``). It is
the same object in ``lightning-sdk run`` (a ``HTTPStore`` against a daemon) and inside ``lightning-sdk train`` (the
trainer's own store and proxy, in process)::

    pool = WorkerPool(agent, store, "http://127.0.0.1:4700", n_workers=8)
    results = await pool.run_until(drain=True)        # until nothing is left to claim; or run_until(done=...)
    pool.stop()                                       # from elsewhere: stop claiming, let in-flight attempts finish
    pool.stop(release=True)                           # ... or hand them back to the queue now

For every attempt: the attempt becomes current (``emit_reward`` finds it), a shared heartbeat loop keeps its lease,
the agent runs under its timeout; then its rewards are posted and it is finished through ``POST /lightning/v1/finish``
(the durability barrier) with its own token. A crash or timeout finishes it as failed with the traceback or stderr
tail, and the store queues the rollout again while attempts remain. A released attempt (shutdown) goes back to the
queue without counting against ``max_attempts``. An attempt whose lease the server expired is reported ``lost``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from lightning_sdk.agent._base import Agent, AttemptOutcome, format_exception
from lightning_sdk.agent._context import AttemptContext, EmittedReward
from lightning_sdk.agent._llm import LLM
from lightning_sdk.agent._server_client import ServerClient
from lightning_sdk.errors import (
    AttemptNotRunningError,
    AuthError,
    InvalidTransitionError,
    LightningSDKError,
    NotFoundError,
    StoreUnavailableError,
)
from lightning_sdk.store.base import Store
from lightning_sdk.types import AttemptStatus, Claim

__all__ = ["AttemptResult", "PoolStats", "ResultStatus", "WorkerPool", "policy_model_name"]

logger = logging.getLogger(__name__)

ResultStatus = Literal["succeeded", "failed", "timed_out", "released", "lost"]


@dataclass(frozen=True)
class AttemptResult:
    """How one attempt ended, as the worker saw it (``error``: traceback, stderr tail or why it was lost)."""

    rollout_id: str
    attempt_id: str
    status: ResultStatus
    task: dict[str, object]
    reward: float | None = None
    error: str | None = None
    duration_s: float = 0.0


@dataclass
class PoolStats:
    """Counters of a pool (read them for a progress view)."""

    claimed: int = 0
    in_flight: int = 0
    by_status: dict[str, int] = field(default_factory=dict)

    def count(self, status: str) -> int:
        return self.by_status.get(status, 0)


async def policy_model_name(store: Store, default: str = "policy") -> str:
    """The model name agents should ask for: the store's policy resource, else ``default``."""
    try:
        resources = await store.get_resources()
    except LightningSDKError as exc:
        logger.warning("cannot read resources from the store (%s); using model %r", exc, default)
        return default
    for r in resources:
        if r.is_policy:
            return r.name
    return default


class WorkerPool:
    """Run ``agent`` on attempts claimed from ``store``; the agent's calls go to ``server_url`` (the proxy root)."""

    def __init__(
        self,
        agent: Agent,
        store: Store,
        server_url: str,
        *,
        n_workers: int = 4,
        model: str = "policy",
        worker_id: str | None = None,
        lease_s: float = 60.0,
        heartbeat_s: float | None = None,
        poll_s: float = 0.5,
        default_timeout: float | None = None,
        split: str | None = None,
        on_result: Callable[[AttemptResult], None] | None = None,
        client: ServerClient | None = None,
        fallback_urls: tuple[str, ...] = (),
    ) -> None:
        """``fallback_urls``: the roots of more proxies on the same store; the agents' ``LLM`` fails over to them
        (docs/scale-out.md)."""
        if n_workers < 1:
            raise LightningSDKError(f"n_workers must be >= 1, got {n_workers}")
        self.agent = agent
        self.store = store
        self.server_url = server_url.rstrip("/")
        self.fallback_urls = tuple(f"{u.rstrip('/')}/v1" for u in fallback_urls)
        self.n_workers = n_workers
        self.model = model
        self.worker_id = worker_id or f"worker-{uuid.uuid4().hex[:8]}"
        self.lease_s = lease_s
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else max(lease_s / 3.0, 0.05)
        self.poll_s = poll_s
        self.default_timeout = default_timeout
        self.split = split
        self.on_result = on_result
        self.stats = PoolStats()
        self.results: list[AttemptResult] = []
        self._client = client or ServerClient(self.server_url)
        self._owns_client = client is None
        self._inflight: dict[asyncio.Task[AttemptResult], Claim] = {}
        self._lost: set[str] = set()  # attempt ids whose lease the server expired
        self._finishing: set[str] = set()  # attempt ids whose agent returned: no more heartbeats, no cancelling
        self._started: set[str] = set()  # attempt ids whose _run_one began (a task cancelled before never runs it)
        self._handing_back: set[asyncio.Task[None]] = set()  # releases of attempts cancelled before they started
        self._stopping = False
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None

    # -- control -------------------------------------------------------------------------------------------------
    def stop(self, *, release: bool = False) -> None:
        """Stop claiming. In-flight attempts finish normally, or with ``release=True`` are cancelled and handed
        back to the queue (they do not count against max_attempts). Safe to call from any thread."""
        loop = self._loop
        if loop is not None and loop.is_running() and threading.current_thread() is not self._loop_thread:
            loop.call_soon_threadsafe(self._stop, release)
        else:
            self._stop(release)

    def _stop(self, release: bool) -> None:
        self._stopping = True
        if release:
            for task, claim in self._inflight.items():
                if claim.attempt.attempt_id not in self._finishing:
                    task.cancel()
        if self._wake is not None:
            self._wake.set()

    @property
    def stopping(self) -> bool:
        return self._stopping

    # -- the loop ------------------------------------------------------------------------------------------------
    async def run_until(self, done: Callable[[], bool] | None = None, *, drain: bool = False) -> list[AttemptResult]:
        """Claim and run attempts until ``stop()``, until ``done()`` is true, or (``drain=True``) until nothing is
        left to claim and nothing is in flight. Returns the results of the attempts run by this call. May be called
        again after it returns, but not after ``stop()`` (a stopped pool claims nothing)."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.current_thread()
        self._wake = asyncio.Event()
        first = len(self.results)
        heartbeat = asyncio.create_task(self._heartbeat_loop(), name="lightning-heartbeat")
        try:
            await self._claim_loop(done, drain)
        finally:
            if self._inflight:
                await asyncio.gather(*self._inflight, return_exceptions=True)
            if self._handing_back:
                await asyncio.gather(*self._handing_back, return_exceptions=True)
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
        return self.results[first:]

    async def _claim_loop(self, done: Callable[[], bool] | None, drain: bool) -> None:
        assert self._wake is not None
        while not self._stopping:
            if done is not None and done():
                return
            if len(self._inflight) >= self.n_workers:
                await self._wait(None)
                continue
            try:
                claim = await self.store.claim(self.worker_id, lease_s=self.lease_s, split=self.split)
            except LightningSDKError as exc:
                logger.warning("claim failed (%s); retrying in %.1f s", exc, self.poll_s)
                await self._wait(self.poll_s)
                continue
            if claim is not None and self._stopping:  # stop() came while the claim was on its way
                result = await self._abandon(claim, time.monotonic())
                self._record(result)
                return
            if claim is None:
                if drain and not self._inflight:
                    return
                await self._wait(self.poll_s)
                continue
            self.stats.claimed += 1
            task = asyncio.create_task(self._run_one(claim), name=f"attempt-{claim.attempt.attempt_id}")
            self._inflight[task] = claim
            self.stats.in_flight = len(self._inflight)
            task.add_done_callback(self._on_done)

    async def _wait(self, timeout: float | None) -> None:
        """Sleep until an attempt ends, ``stop()`` is called, or ``timeout`` passes."""
        assert self._wake is not None
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    def _on_done(self, task: asyncio.Task[AttemptResult]) -> None:
        claim = self._inflight.pop(task, None)
        self.stats.in_flight = len(self._inflight)
        ran = claim is not None and claim.attempt.attempt_id in self._started
        if claim is not None:
            self._started.discard(claim.attempt.attempt_id)
        if claim is not None and not ran and task.cancelled():
            # cancelled before its first step (a release right after the claim): its coroutine never ran, so the
            # release _run_one would have made is made here, or the attempt would hold its rollout until its lease
            # expired
            back = asyncio.get_running_loop().create_task(self._hand_back(claim), name="lightning-hand-back")
            self._handing_back.add(back)
            back.add_done_callback(self._handing_back.discard)
        if self._wake is not None:
            self._wake.set()

    async def _hand_back(self, claim: Claim) -> None:
        self._record(await self._abandon(claim, time.monotonic()))

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            for task, claim in list(self._inflight.items()):
                attempt_id = claim.attempt.attempt_id
                if attempt_id in self._finishing:
                    continue
                try:
                    await self.store.heartbeat(attempt_id, lease_s=self.lease_s)
                except (InvalidTransitionError, NotFoundError, AttemptNotRunningError) as exc:
                    if attempt_id in self._finishing or task.done():
                        # the benign race: the agent returned and this worker finished the attempt while the
                        # heartbeat was on its way ("cannot heartbeat, it is 'succeeded'"); nothing is lost
                        logger.debug("heartbeat of %s raced its finish (%s)", attempt_id, exc)
                        continue
                    logger.warning("attempt %s is no longer running on the server (%s); abandoning it", attempt_id, exc)
                    self._lost.add(attempt_id)
                    task.cancel()
                except Exception as exc:  # keep beating for the others; the lease outlives a few misses
                    logger.warning("heartbeat of %s failed (%r); will retry", attempt_id, exc)

    # -- one attempt ---------------------------------------------------------------------------------------------
    async def _run_one(self, claim: Claim) -> AttemptResult:
        attempt, rollout = claim.attempt, claim.rollout
        self._started.add(attempt.attempt_id)
        llm = LLM(
            base_url=f"{self.server_url}/v1", api_key=attempt.token, model=self.model, fallback_urls=self.fallback_urls
        )
        ctx = AttemptContext(attempt.attempt_id, rollout.rollout_id, rollout.task, llm, server_url=self.server_url)
        timeout = self.agent.timeout if self.agent.timeout is not None else self.default_timeout
        started = time.monotonic()
        try:
            outcome = await self.agent.run_attempt(ctx, timeout=timeout)
        except asyncio.CancelledError:
            ctx.close()
            result = await asyncio.shield(self._abandon(claim, started))
            self._record(result)
            return result
        except Exception as exc:  # a bug outside the agent's own code: still fail the attempt, never lose it
            outcome = AttemptOutcome("failed", error=format_exception(exc))
        emitted = ctx.close()
        self._finishing.add(attempt.attempt_id)
        try:
            # shielded: a release or shutdown must not cut the durability barrier in half
            result = await asyncio.shield(self._finish(claim, outcome, emitted, started))
        finally:
            self._finishing.discard(attempt.attempt_id)
        self._record(result)
        return result

    async def _finish(
        self, claim: Claim, outcome: AttemptOutcome, emitted: list[EmittedReward], started: float
    ) -> AttemptResult:
        attempt = claim.attempt
        token = attempt.token
        reward: float | None = outcome.reward
        status: ResultStatus = outcome.status
        error = outcome.error
        try:
            if outcome.status == "succeeded":
                refused = await self._post_rewards(token, emitted, outcome)
                if refused is None:
                    finals = [r.value for r in emitted if r.call_id is None and r.name == "reward"]
                    if outcome.reward is None and finals:
                        reward = finals[-1]
                    await self._client.finish(token, "succeeded")
                else:  # a reward the server refused (e.g. an unknown call_id): fail loudly, never drop it silently
                    status, error = "failed", refused
                    await self._client.finish(token, "failed", error=error)
            else:
                await self._client.finish(token, "failed", error=error)
        except AttemptNotRunningError as exc:
            status, error = "lost", f"{exc}\n(the server ended the attempt first: lease expired or cancelled)"
        except LightningSDKError as exc:
            status, error = "lost", f"could not finish the attempt: {exc}"
        return AttemptResult(
            claim.rollout.rollout_id,
            attempt.attempt_id,
            status,
            claim.rollout.task,
            reward=reward,
            error=error,
            duration_s=time.monotonic() - started,
        )

    async def _post_rewards(self, token: str, emitted: list[EmittedReward], outcome: AttemptOutcome) -> str | None:
        """Post the attempt's rewards; the error text of the first one the server refuses (HTTP 4xx), else None."""
        pending = [(r.value, r.name, r.call_id) for r in emitted]
        if outcome.reward is not None:
            pending.append((outcome.reward, "reward", None))
        for value, name, call_id in pending:
            try:
                await self._client.reward(token, value, name, call_id)
            except (AttemptNotRunningError, AuthError, StoreUnavailableError):
                raise
            except LightningSDKError as exc:
                return f"the server refused the reward {name!r}={value} (call_id={call_id}): {exc}"
        return None

    async def _abandon(self, claim: Claim, started: float) -> AttemptResult:
        """A cancelled attempt: released back to the queue on shutdown, or lost when the server expired it."""
        attempt_id = claim.attempt.attempt_id
        status: ResultStatus = "lost" if attempt_id in self._lost else "released"
        error = "lease expired on the server" if status == "lost" else "released by a worker shutting down"
        if status == "released":
            try:
                await self.store.finish_attempt(attempt_id, AttemptStatus.RELEASED, error=error)
            except LightningSDKError as exc:
                status, error = "lost", f"could not release the attempt ({exc}); its lease will expire"
        return AttemptResult(
            claim.rollout.rollout_id,
            attempt_id,
            status,
            claim.rollout.task,
            error=error,
            duration_s=time.monotonic() - started,
        )

    def _record(self, result: AttemptResult) -> None:
        self.results.append(result)
        self.stats.by_status[result.status] = self.stats.count(result.status) + 1
        if result.status not in ("succeeded", "released"):
            logger.info("attempt %s %s: %s", result.attempt_id, result.status, (result.error or "")[-300:])
        if self.on_result is not None:
            try:
                self.on_result(result)
            except Exception:
                logger.exception("on_result callback failed")

    async def close(self) -> None:
        if self._owns_client:
            await self._client.close()
