"""The proxy's Prometheus call metrics as an observer on the call pipeline's seam (``proxy/observe.py``).

``Proxy`` puts a ``CallMetrics`` first among its observers whenever it has an ``OpsMetrics`` (``GET /metrics``):
every LLM request counts in ``lightning_sdk_calls_total{route, status, mode}`` and the duration histogram, a
recorded call's ids in the token histograms (``kind="prompt"``: ``len(prompt_ids)``, ``kind="completion"``:
``len(completion_ids)``), requests being served in ``lightning_sdk_calls_in_flight``, and each attempt ended here
in ``lightning_sdk_attempts_ended_total{status}``. ``route`` is the API surface (``chat.completions``,
``completions``, ``responses``, ``messages``: a session route ``/t/<token>/...`` counts with its surface, and no
token reaches a label); ``mode`` is ``token``, ``passthrough``, ``external``, or ``none`` for a request refused
before a backend was chosen.
"""

from __future__ import annotations

from lightning_sdk.monitoring import OpsMetrics
from lightning_sdk.proxy.observe import CallEnd, CallObserver, CallStart, FinishEvent

__all__ = ["CallMetrics"]


class CallMetrics(CallObserver):
    """Counts every call, its duration and its recorded tokens into ``metrics`` (see the module docstring)."""

    __slots__ = ("metrics",)

    def __init__(self, metrics: OpsMetrics) -> None:
        self.metrics = metrics

    def call_started(self, start: CallStart) -> None:
        self.metrics.call_started()

    def call_ended(self, end: CallEnd) -> None:
        call = end.call
        prompt, completion = (len(call.prompt_ids), len(call.completion_ids)) if call is not None else (0, 0)
        self.metrics.call_ended(end.start.surface, end.status, end.mode or "none", end.duration_s, prompt, completion)

    def finished(self, event: FinishEvent) -> None:
        self.metrics.attempt_ended(event.status)
