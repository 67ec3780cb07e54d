"""The metric families of a proxy or daemon, on a registry of its own, and the ``GET /metrics`` route.

    proxy call ──observer──▶ calls_total{route,status,mode}, call_duration_seconds, call_tokens, calls_in_flight
    recorder   ──────────────▶ recorder_queue_depth (read at scrape), record_write_seconds, store_errors_total{op}
    finish     ──────────────▶ attempts_ended_total{status}
    scrape     ──store read──▶ rollouts{status}, groups_ready, policy_version
    trainer    ──step report─▶ learner_step_seconds, staleness, weight_publication_seconds, policy_version

Every family is named ``lightning_sdk_*``; counters end in ``_total`` in the text format (prometheus_client adds
it). What each one means is in docs/proxy.md ("Metrics"). The call families cost the hot path a dict lookup and a
few plain adds: they are kept as plain numbers on the event loop and turned into Prometheus families at scrape
(``_CallCollector``), not through prometheus_client's lock-guarded children.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

__all__ = ["CALL_LATENCY_BUCKETS", "TOKEN_BUCKETS", "OpsMetrics", "metrics_route"]

logger = logging.getLogger(__name__)

CALL_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Seconds from a call's request to its last byte (an agent's LLM call: tens of ms to minutes)."""

TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536, 262144)
"""Tokens of one call's prompt or completion."""

_STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
_WRITE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
_STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)

Refresh = Callable[[], Awaitable[None]]


class OpsMetrics:
    """One app's metrics (see the module docstring). ``refreshers`` run before each scrape (reads of the store
    that are too costly to keep current on every call); one that fails is logged and counted as a store error
    with ``op="scrape"``, and the scrape still answers with the rest."""

    def __init__(self, registry: CollectorRegistry | None = None, *, refresh_timeout_s: float = 5.0) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.refresh_timeout_s = refresh_timeout_s
        self.refreshers: list[Refresh] = []
        r = self.registry
        p = "lightning_sdk_"
        # -- calls ---------------------------------------------------------------------------------------------
        self.calls = _CallCollector(p)  # calls_total, call_duration_seconds, call_tokens, calls_in_flight
        r.register(self.calls)
        # -- recording and the store ---------------------------------------------------------------------------
        self.recorder_queue = Gauge(
            p + "recorder_queue_depth", "Calls and rewards queued for the store, not yet written", registry=r
        )
        self.record_write = Histogram(
            p + "record_write_seconds",
            "Seconds one recorder batch took to commit (calls and rewards, retries included)",
            buckets=_WRITE_BUCKETS,
            registry=r,
        )
        self.recorded = Counter(
            p + "recorded", "Items committed to the store by the recorder: kind=call or reward", ("kind",), registry=r
        )
        self.store_errors = Counter(
            p + "store_errors",
            "Store operations that failed: op=record_batch (a batch, then retried item by item), record_item (an "
            "item lost), scrape (a read for /metrics)",
            ("op",),
            registry=r,
        )
        # -- attempts and rollouts -----------------------------------------------------------------------------
        self.attempts_ended = Counter(
            p + "attempts_ended",
            "Attempts this server ended through its finish barrier, by final status",
            ("status",),
            registry=r,
        )
        self.rollouts = Gauge(
            p + "rollouts", "Rollouts in the store by status (read at scrape)", ("status",), registry=r
        )
        self.groups_ready = Gauge(
            p + "groups_ready", "Finished, unconsumed train groups waiting for the learner (read at scrape)", registry=r
        )
        # -- training ------------------------------------------------------------------------------------------
        self.learner_step = Histogram(
            p + "learner_step_seconds",
            "Seconds of one learner step (forward, backward, optimizer)",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.staleness = Histogram(
            p + "staleness",
            "Policy versions between the version a trained group was sampled with and the one it trained",
            buckets=_STALENESS_BUCKETS,
            registry=r,
        )
        self.policy_version = Gauge(p + "policy_version", "Policy version being served", registry=r)
        self.publication = Histogram(
            p + "weight_publication_seconds",
            "Seconds to take a step's weights and hand them to the engine",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.version_is_read = False  # True: policy_version reads the engine at scrape (served_version_from)

    # -- the hot path ----------------------------------------------------------------------------------------------
    def call_started(self) -> None:
        self.calls.started += 1

    def call_ended(
        self, route: str, status: int, mode: str, seconds: float, prompt_tokens: int, completion_tokens: int
    ) -> None:
        """One call answered: its route, HTTP status, mode, wall seconds and the lengths of its recorded ids (0 and
        0 for a call that recorded none: not observed in the token histograms)."""
        calls = self.calls
        calls.ended += 1
        key = (route, status, mode)
        series = calls.series.get(key)
        if series is None:
            series = calls.series[key] = _CallSeries()
        series.count += 1
        series.latency.observe(seconds)
        if prompt_tokens or completion_tokens:
            series.prompt.observe(prompt_tokens)
            series.completion.observe(completion_tokens)

    # -- the recorder ----------------------------------------------------------------------------------------------
    def record_written(self, seconds: float, calls: int, rewards: int) -> None:
        self.record_write.observe(seconds)
        if calls:
            self.recorded.labels("call").inc(calls)
        if rewards:
            self.recorded.labels("reward").inc(rewards)

    def store_error(self, op: str) -> None:
        self.store_errors.labels(op).inc()

    def queue_depth_from(self, depth: Callable[[], float]) -> None:
        """Read the recorder's queue depth at scrape time."""
        self.recorder_queue.set_function(depth)

    # -- attempts --------------------------------------------------------------------------------------------------
    def attempt_ended(self, status: str) -> None:
        self.attempts_ended.labels(status).inc()

    def set_counts(self, counts: dict[str, int]) -> None:
        """``Store.counts()``: rollouts by status plus ``groups_ready``."""
        for key, value in counts.items():
            if key == "groups_ready":
                self.groups_ready.set(value)
            else:
                self.rollouts.labels(key).set(value)

    # -- training --------------------------------------------------------------------------------------------------
    def training_step(self, learner_s: float | None, publish_s: float | None, staleness: Iterable[int]) -> None:
        """One training step: the learner's seconds and the publication's (None: the step trained nothing, so
        there was neither), and each trained group's staleness."""
        if learner_s is not None:
            self.learner_step.observe(learner_s)
        if publish_s is not None:
            self.publication.observe(publish_s)
        for s in staleness:
            self.staleness.observe(s)

    def served_version_from(self, version: Callable[[], float]) -> None:
        """Read the policy version at scrape from the engine that serves it (the daemon), instead of the store's
        latest publication (a tracing proxy)."""
        self.policy_version.set_function(version)
        self.version_is_read = True

    # -- scrape ----------------------------------------------------------------------------------------------------
    async def render(self) -> bytes:
        """Run the refreshers (bounded by ``refresh_timeout_s`` each), then the text format."""
        for refresh in self.refreshers:
            try:
                await asyncio.wait_for(refresh(), self.refresh_timeout_s)
            except Exception as exc:  # a scrape answers with what it has; the failure is counted and logged
                logger.warning("metrics: a scrape-time read failed: %s", exc)
                self.store_error("scrape")
        return generate_latest(self.registry)


class _Hist:
    """A histogram's buckets (not cumulative; the last one is +Inf) and sum, kept with plain adds."""

    __slots__ = ("bounds", "buckets", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.buckets = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.buckets[bisect.bisect_left(self.bounds, value)] += 1  # le: a value equal to a bound counts in it
        self.sum += value

    def add(self, other: _Hist) -> None:
        for i, n in enumerate(other.buckets):
            self.buckets[i] += n
        self.sum += other.sum

    def exposed(self) -> tuple[list[tuple[str, float]], float]:
        """(cumulative ``(le, count)`` pairs ending with ``+Inf``, sum): what ``HistogramMetricFamily`` takes."""
        out: list[tuple[str, float]] = []
        total = 0
        for bound, n in zip((*map(floatToGoString, self.bounds), "+Inf"), self.buckets, strict=True):
            total += n
            out.append((bound, total))
        return out, self.sum


class _CallSeries:
    """What one (route, status, mode) counted: calls, their durations and recorded tokens."""

    __slots__ = ("completion", "count", "latency", "prompt")

    def __init__(self) -> None:
        self.count = 0
        self.latency = _Hist(CALL_LATENCY_BUCKETS)
        self.prompt = _Hist(TOKEN_BUCKETS)
        self.completion = _Hist(TOKEN_BUCKETS)


class _CallCollector(Collector):
    """The call families, counted on the event loop with plain adds (no lock, no ``labels()`` lookup per call) and
    turned into Prometheus families at scrape (which runs on the same loop)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.series: dict[tuple[str, int, str], _CallSeries] = {}
        self.started = 0
        self.ended = 0

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        p = self.prefix
        calls = CounterMetricFamily(
            p + "calls", "LLM calls answered, by route, HTTP status and mode", labels=("route", "status", "mode")
        )
        latency: dict[tuple[str, str], _Hist] = {}
        tokens: dict[tuple[str, str, str], _Hist] = {}
        for (route, status, mode), series in list(self.series.items()):
            calls.add_metric([route, str(status), mode], series.count)
            latency.setdefault((route, mode), _Hist(CALL_LATENCY_BUCKETS)).add(series.latency)
            tokens.setdefault((route, mode, "prompt"), _Hist(TOKEN_BUCKETS)).add(series.prompt)
            tokens.setdefault((route, mode, "completion"), _Hist(TOKEN_BUCKETS)).add(series.completion)
        yield calls
        duration = HistogramMetricFamily(
            p + "call_duration_seconds",
            "Seconds from a call's request to its last answered byte",
            labels=("route", "mode"),
        )
        for labels, hist in latency.items():
            buckets, total = hist.exposed()
            duration.add_metric(list(labels), buckets, total)
        yield duration
        token_family = HistogramMetricFamily(
            p + "call_tokens",
            "Tokens of a recorded call: kind=prompt (prompt ids) or completion (completion ids)",
            labels=("route", "mode", "kind"),
        )
        for token_labels, hist in tokens.items():
            buckets, total = hist.exposed()
            token_family.add_metric(list(token_labels), buckets, total)
        yield token_family
        yield GaugeMetricFamily(p + "calls_in_flight", "LLM calls being served now", value=self.started - self.ended)


def metrics_route(metrics: OpsMetrics, path: str = "/metrics") -> Route:
    """``GET /metrics`` (no key): Prometheus' text format of ``metrics``."""

    async def endpoint(request: Request) -> Response:
        return Response(await metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return Route(path, endpoint, methods=["GET"])
