"""The proxy's spans: a ``CallObserver`` (``proxy/observe.py``) that turns calls, rewards and finishes into spans.

``call_ended`` with a recorded call: its span (refusals before anything was recorded have no call, so no span);
``reward``: kept for the attempt's span; ``finished``: the attempt's root span, from its first call's start seen
here to the finish, with the rewards and the finish as events. Everything runs on the proxy's loop and only builds
a span object and queues it (the SDK's batch processor exports on its own thread).
"""

from __future__ import annotations

from lightning_sdk.proxy.observe import CallEnd, CallObserver, FinishEvent, RewardEvent
from lightning_sdk.telemetry.spans import _MAX_OPEN, BoundedDict, Telemetry
from lightning_sdk.types import Reward, now

__all__ = ["SpanObserver"]


class SpanObserver(CallObserver):
    """Spans of the proxy's calls and attempts through ``telemetry``."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self._first: BoundedDict[str, float] = BoundedDict(_MAX_OPEN)  # attempt -> its first call's start

    def call_ended(self, end: CallEnd) -> None:
        call = end.call
        if call is None:
            return
        if call.attempt_id not in self._first:
            self._first[call.attempt_id] = call.started_at
        self.telemetry.call(call)

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
        self.telemetry.attempt(
            event.attempt_id,
            event.rollout_id,
            status=event.status,
            error=event.error,
            started_at=self._first.pop(event.attempt_id, ended),
            ended_at=ended,
            calls=event.calls,
        )
