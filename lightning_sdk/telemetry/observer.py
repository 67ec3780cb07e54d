"""The proxy's spans: a ``CallObserver`` (``proxy/observe.py``) that turns calls, rewards and finishes into spans.

``call_ended`` with a recorded call: its span (refusals before anything was recorded have no call, so no span),
a child of the agent's own span when the request's ``traceparent`` belongs to the attempt's trace; ``reward``: kept
for the attempt's span; ``finished``: the attempt's root span, from its first call's start seen here to the finish,
with the rewards and the finish as events. Both spans carry the rollout's group and split (``rl.group_id``,
``rl.split``), read once per rollout from the proxy's store (``attach``) in a task of their own, so the call that
asks never waits for it; a span whose lookup failed goes out without them. Everything else runs on the proxy's
loop and only builds a span object and queues it (the SDK's batch processor exports on its own thread).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from lightning_sdk.proxy.observe import CallEnd, CallObserver, FinishEvent, RewardEvent
from lightning_sdk.store import Store
from lightning_sdk.telemetry.spans import _MAX_OPEN, BoundedDict, Telemetry
from lightning_sdk.types import Reward, now

__all__ = ["SpanObserver"]

logger = logging.getLogger(__name__)

_Emit = Callable[[str | None, str | None], None]  # (group_id, split) -> queue the span


class SpanObserver(CallObserver):
    """Spans of the proxy's calls and attempts through ``telemetry``."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self._first: BoundedDict[str, float] = BoundedDict(_MAX_OPEN)  # attempt -> its first call's start
        self._store: Store | None = None
        self._rollouts: BoundedDict[str, tuple[str, str]] = BoundedDict(_MAX_OPEN)  # rollout -> (group, split)
        self._waiting: dict[str, list[_Emit]] = {}  # rollout -> spans waiting for its lookup
        self._lookups: set[asyncio.Task[None]] = set()

    def attach(self, store: Store) -> None:
        self._store = store

    def _with_rollout(self, rollout_id: str, emit: _Emit) -> None:
        """``emit(group_id, split)`` now when the rollout is known (or there is no store to ask), else once a
        lookup of it (one per rollout, however many spans wait) has answered."""
        known = self._rollouts.get(rollout_id)
        if known is not None or self._store is None:
            emit(*(known or (None, None)))
            return
        waiting = self._waiting.get(rollout_id)
        if waiting is not None:
            waiting.append(emit)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on a loop (a direct call): no lookup
            emit(None, None)
            return
        self._waiting[rollout_id] = [emit]
        task = loop.create_task(self._look_up(self._store, rollout_id))
        self._lookups.add(task)
        task.add_done_callback(self._lookups.discard)

    async def _look_up(self, store: Store, rollout_id: str) -> None:
        group: str | None = None
        split: str | None = None
        try:
            rollout = (await store.get_rollout(rollout_id)).rollout
            group, split = rollout.group_id, rollout.split
            self._rollouts[rollout_id] = (group, split)
        except Exception as exc:  # the spans go out without the group and split
            logger.debug("telemetry: no group/split for rollout %s: %r", rollout_id, exc)
        finally:
            for emit in self._waiting.pop(rollout_id, []):
                emit(group, split)

    def call_ended(self, end: CallEnd) -> None:
        call = end.call
        if call is None:
            return
        if call.attempt_id not in self._first:
            self._first[call.attempt_id] = call.started_at
        traceparent = end.start.traceparent
        self._with_rollout(
            call.rollout_id,
            lambda group, split: self.telemetry.call(call, group_id=group, split=split, traceparent=traceparent),
        )

    def reward(self, event: RewardEvent) -> None:
        self.telemetry.reward(
            Reward(
                rollout_id=event.rollout_id,
                attempt_id=event.attempt_id,
                value=event.value,
                name=event.name,
                call_id=event.call_id,
            )
        )

    def finished(self, event: FinishEvent) -> None:
        ended = now()
        started = self._first.pop(event.attempt_id, ended)
        rewards = self.telemetry.take_rewards(event.attempt_id)  # the ones recorded up to this finish
        self._with_rollout(
            event.rollout_id,
            lambda group, split: self.telemetry.attempt(
                event.attempt_id,
                event.rollout_id,
                status=event.status,
                error=event.error,
                started_at=started,
                ended_at=ended,
                calls=event.calls,
                rewards=rewards,
                group_id=group,
                split=split,
            ),
        )
