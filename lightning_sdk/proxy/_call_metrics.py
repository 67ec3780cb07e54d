"""The proxy's Prometheus call metrics, and the same as an observer on the call pipeline's seam.

The proxy counts its calls into its ``OpsMetrics`` straight from the pipeline (``proxy/_call.py``: two plain calls
per request, ``OpsMetrics.call_started`` / ``call_ended``, and ``attempt_ended`` at a finish), not through the
observer seam: building a ``CallStart`` and a ``CallEnd`` and dispatching them for every call cost more than the
counting itself (``benchmarks/proxy_inprocess.py --compare-metrics``; docs/proxy.md). Every LLM request counts in
``lightning_sdk_calls_total{route, status, mode}`` and the duration histogram, a recorded call's ids in the token
histograms (``kind="prompt"``: ``len(prompt_ids)``, ``kind="completion"``: ``len(completion_ids)``), requests being
served in ``lightning_sdk_calls_in_flight``, and each attempt ended here in ``lightning_sdk_attempts_ended_total
{status}``. ``route`` is the API surface (``chat.completions``, ``completions``, ``responses``, ``messages``: a
session route ``/t/<token>/...`` counts with its surface, and no token reaches a label); ``mode`` is ``token``,
``passthrough``, ``external``, or ``none`` for a request refused before a backend was chosen.

``CallMetrics`` counts the same from the seam's events, for an ``OpsMetrics`` fed by another process's events.
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
