"""The proxy's state: the store, the backends, the recorder, the attempts, and the finish barrier.

``Proxy`` is what the routes share (``app.state.proxy``): the call pipeline (``proxy/_call.py``) reads the attempt
cache, the backend for a model, the current policy version and the observers here; ``end_attempt`` is the
barrier of ``finish`` (every call and reward of an attempt committed before it ends); ``list_models``,
``get_model`` and ``health`` answer their routes. The routing table and the lifespan are in ``proxy/_app.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from lightning_sdk.errors import AttemptNotRunningError, StoreUnavailableError
from lightning_sdk.http_errors import bearer_token
from lightning_sdk.monitoring import OpsMetrics
from lightning_sdk.proxy._attempts import AttemptCache, AttemptState
from lightning_sdk.proxy._backend import PolicyBackend
from lightning_sdk.proxy._errors import ProxyHTTPError
from lightning_sdk.proxy._external import ExternalBackend
from lightning_sdk.proxy._hangup import HangUpSweeper
from lightning_sdk.proxy._recorder import Recorder
from lightning_sdk.proxy._shared import CommitWriter, SharedStore, is_shared
from lightning_sdk.proxy.observe import CallObserver, FinishEvent, RewardEvent, notify_finished, notify_reward
from lightning_sdk.store.base import Store
from lightning_sdk.types import Attempt, AttemptStatus, Reward

__all__ = ["Proxy", "ProxyConfig"]

logger = logging.getLogger(__name__)

_JSON = "application/json"


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
        observers: Sequence[CallObserver] = (),
        metrics: OpsMetrics | None = None,
    ) -> None:
        self.store = store
        self.close_store = close_store
        self.backend = policy_backend
        self.external = external
        self.admin_key = admin_key
        self.config = config or ProxyConfig()
        self.observers: tuple[CallObserver, ...] = tuple(observers)  # see proxy/observe.py (empty: no cost)
        if metrics is None and self.config.metrics:
            metrics = OpsMetrics()
        self.metrics = metrics
        self.recorder = Recorder(
            store, max_pending=self.config.max_pending_records, max_batch=self.config.record_batch, metrics=metrics
        )
        # A store many proxies share (proxy/_shared.py): calls are numbered by the store and committed, with the
        # store-side finish barrier, before they are answered. None: the single-proxy path (barrier in memory).
        self.shared: SharedStore | None = store if is_shared(store) else None  # type: ignore[assignment]
        self.commits = (
            CommitWriter(self.shared, max_batch=self.config.record_batch, metrics=metrics) if self.shared else None
        )
        if metrics is not None:
            metrics.refreshers.append(self._refresh_metrics)  # the call pipeline counts into it directly
        for observer in self.observers:
            observer.attach(store)
        after_s = self.config.hang_up_watch_after_s
        self.hang_ups = HangUpSweeper(after_s) if after_s > 0 else None  # arms the calls' hang-up watches
        self.attempts = AttemptCache(
            store,
            ttl_s=self.config.token_ttl_s,
            busy=lambda attempt_id: self.recorder.pending_for(attempt_id) > 0,
            keep_calls=policy_backend.reads_earlier_calls,
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

    async def add_reward(self, reward: Reward) -> None:
        """Queue a reward for the store (and tell the observers)."""
        await self.recorder.add_reward(reward)
        if self.observers:
            event = RewardEvent(reward.attempt_id, reward.rollout_id, reward.name, reward.value, reward.call_id)
            notify_reward(self.observers, event)

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
        landed: int | None = None  # a shared store counts the calls every proxy recorded
        try:
            if self.shared is not None:
                attempt, landed = await self.shared.finish_counting(attempt_id, final, why)
            else:
                attempt = await self.store.finish_attempt(attempt_id, final, why)
        except (StoreUnavailableError, asyncio.CancelledError):
            state.closing = None
            raise
        except BaseException:
            state.closing = "ended"
            raise
        self.attempts.ended(state.attempt.token, attempt)
        lost_calls = sum(1 for f in failures if f.startswith("call "))
        n_calls = state.n_calls - lost_calls if landed is None else landed
        if self.metrics is not None:
            self.metrics.attempt_ended(attempt.status.value)
        if self.observers:
            event = FinishEvent(
                attempt.attempt_id, attempt.rollout_id, attempt.status.value, why, n_calls,
                state.n_errors, aborted,
            )  # fmt: skip
            notify_finished(self.observers, event)
        return {
            "rollout_id": attempt.rollout_id,
            "attempt_id": attempt.attempt_id,
            "status": attempt.status.value,
            "calls": n_calls,
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
                names = await self.backend.models()  # an SDK error answers by the app's exception handler
            if self.external is not None:
                names = names + [n for n in self.external.routes if n not in names]
            self._models = (t, names)
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "lightning-sdk"} for n in names]
        return Response(orjson.dumps({"object": "list", "data": data}), media_type=_JSON)

    async def get_model(self, request: Request) -> Response:
        """``GET /v1/models/{id}`` (the OpenAI SDK's ``models.retrieve``): 404 for a model not served here."""
        model_id = request.path_params["model_id"]
        listed = await self.list_models(request)
        for entry in orjson.loads(listed.body)["data"]:
            if entry["id"] == model_id:
                return Response(orjson.dumps(entry), media_type=_JSON)
        raise ProxyHTTPError(404, f"model {model_id!r} is not served here", param="model", code="model_not_found")

    async def health(self, request: Request) -> Response:
        info: dict[str, Any] = {"status": "ok", "pending_records": self.recorder.pending}
        upstream = self.backend.upstream_state()
        if upstream is not None:
            info["upstream"] = upstream
        return Response(orjson.dumps(info), media_type=_JSON)
