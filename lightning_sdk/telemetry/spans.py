"""Spans of what the proxy and the trainer recorded, exported through the OpenTelemetry SDK (OTLP/HTTP or gRPC).

Spans are built from recorded data when the thing they describe has ended (a call once answered, an attempt once
finished, a step once checkpointed), with their recorded start and end times and the ids of ``telemetry/ids.py``,
and handed to the SDK's ``BatchSpanProcessor`` (a background thread exports them): nothing waits on the collector.

    trace of attempt A (trace id from A)
      attempt span  "rl.attempt"         rl.attempt_id, rl.rollout_id, rl.group_id, rl.split, status, reward;
                                         events: "rl.reward" (one per reward), "rl.finish"
        call span   "chat policy"        GenAI conventions (gen_ai.operation.name, gen_ai.request.model,
                                         gen_ai.usage.input_tokens/output_tokens = the recorded ids' lengths,
                                         gen_ai.response.finish_reasons) + rl.* (policy version, token source,
                                         split reason, failure); the agent's own span is its parent when the
                                         request's traceparent is in A's trace
    trace of step S
      step span     "rl.step"            rl.step, rl.policy_version, loss, advantage stats; linked to every
                                         attempt span it trained
        publication "rl.publish"         rl.policy_version (the weights published after the step)

Off (no endpoint): ``open_telemetry`` returns None and callers skip on ``is None``: no SDK import, no cost.
"""

from __future__ import annotations

import collections
import functools
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from lightning_sdk.telemetry.config import TelemetryConfig
from lightning_sdk.telemetry.ids import attempt_span_id, attempt_trace_id, call_span_id, parse_traceparent
from lightning_sdk.types import Call, Reward

__all__ = ["BoundedDict", "StepSpan", "Telemetry", "open_telemetry"]

logger = logging.getLogger(__name__)

_SCOPE = "lightning_sdk"
_MAX_OPEN = 65536  # attempts whose rewards / first call time are kept until their finish

K = TypeVar("K")
V = TypeVar("V")


class BoundedDict(OrderedDict[K, V]):
    """A dict that forgets its oldest entry past ``cap`` entries (per-attempt state of attempts never finished)."""

    def __init__(self, cap: int) -> None:
        super().__init__()
        self.cap = cap

    def __setitem__(self, key: K, value: V) -> None:
        super().__setitem__(key, value)
        if len(self) > self.cap:
            self.popitem(last=False)


def _ns(t: float | None) -> int:
    return int((t if t is not None else time.time()) * 1e9)


@dataclass(frozen=True, slots=True)
class StepSpan:
    """What the step span says: the attempts it trained and its numbers."""

    step: int
    version: int
    attempt_ids: Sequence[str]
    started_at: float
    ended_at: float
    loss: float | None = None
    advantages: Sequence[float] = ()
    records: int = 0
    groups: int = 0
    staleness_mean: float | None = None


class Telemetry:
    """The span exporter of one process (the proxy's, the trainer's); ``shutdown`` flushes what is queued."""

    def __init__(self, config: TelemetryConfig, *, exporter: Any = None) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self.config = config
        self.resource = Resource.create({"service.name": config.service_name or "lightning-sdk"})
        self.scope = InstrumentationScope(_SCOPE)
        self.exporter = exporter if exporter is not None else _exporter(config)
        self.processor = BatchSpanProcessor(self.exporter)
        # Spans are built off the caller's thread: the proxy's loop only appends a closure (see ``_submit``).
        self._jobs: collections.deque[Callable[[], None]] = collections.deque()
        self._wake = threading.Event()
        self._busy = False
        self._stopping = False
        self._thread = threading.Thread(target=self._work, name="lightning-sdk-telemetry", daemon=True)
        self._thread.start()
        # running attempts' rewards, until their finish (bounded: an attempt never finished here is forgotten)
        self._rewards: BoundedDict[str, list[Reward]] = BoundedDict(_MAX_OPEN)

    # -- building spans ----------------------------------------------------------------------------------------
    def _emit(self, *args: Any, **kwargs: Any) -> None:
        """Build the span on the telemetry thread (``_emit_now``)."""
        self._submit(functools.partial(self._emit_now, *args, **kwargs))

    def _submit(self, job: Callable[[], None]) -> None:
        self._jobs.append(job)  # deque.append is atomic; the thread drains it
        if not self._busy:
            self._wake.set()

    def _work(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            self._busy = True
            self._drain()
            self._busy = False
            if self._jobs:  # appended after the drain while busy: the submitter did not wake us
                self._wake.set()
            if self._stopping:
                self._drain()
                return

    def _drain(self) -> None:
        while self._jobs:
            job = self._jobs.popleft()
            try:
                job()
            except Exception:  # a span that cannot be built is logged and dropped, never raised into a call
                logger.exception("telemetry: a span could not be built")

    def _emit_now(
        self,
        name: str,
        trace_id: int,
        span_id: int,
        *,
        parent: tuple[int, int] | None,
        start: float | None,
        end: float | None,
        attributes: Mapping[str, Any],
        events: Sequence[tuple[str, float | None, Mapping[str, Any]]] = (),
        links: Sequence[tuple[int, int, Mapping[str, Any]]] = (),
        kind: str = "internal",
        error: str | None = None,
    ) -> None:
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

        def ctx(trace: int, span: int, remote: bool) -> SpanContext:
            return SpanContext(trace, span, is_remote=remote, trace_flags=TraceFlags(TraceFlags.SAMPLED))

        span = ReadableSpan(
            name,
            context=ctx(trace_id, span_id, False),
            parent=ctx(*parent, True) if parent is not None else None,
            resource=self.resource,
            attributes={k: v for k, v in attributes.items() if v is not None},
            events=[Event(n, {k: v for k, v in a.items() if v is not None}, timestamp=_ns(t)) for n, t, a in events],
            links=[Link(ctx(t, s, True), {k: v for k, v in a.items() if v is not None}) for t, s, a in links],
            kind=SpanKind.CLIENT if kind == "client" else SpanKind.INTERNAL,
            status=Status(StatusCode.ERROR, error) if error else Status(StatusCode.OK),
            start_time=_ns(start),
            end_time=_ns(end if end is not None else start),
            instrumentation_scope=self.scope,
        )
        self.processor.on_end(span)

    # -- the proxy's spans -------------------------------------------------------------------------------------
    def call(
        self,
        call: Call,
        *,
        group_id: str | None = None,
        split: str | None = None,
        traceparent: str | None = None,
    ) -> None:
        """Queue the span of one recorded call (built on the telemetry thread; see ``_call_span``)."""
        self._submit(functools.partial(self._call_span, call, group_id, split, traceparent))

    def _call_span(self, call: Call, group_id: str | None, split: str | None, traceparent: str | None) -> None:
        self._call_now(call, group_id=group_id, split=split, traceparent=traceparent)

    def _call_now(
        self,
        call: Call,
        *,
        group_id: str | None = None,
        split: str | None = None,
        traceparent: str | None = None,
    ) -> None:
        """The span of one recorded call, a child of its attempt's span (or of the agent's own span, when the
        request's ``traceparent`` belongs to the attempt's trace)."""
        trace_id = attempt_trace_id(call.attempt_id)
        parent = (trace_id, attempt_span_id(call.attempt_id))
        theirs = parse_traceparent(traceparent)
        if theirs is not None and theirs[0] == trace_id:
            parent = theirs
        render = call.checks.get("render") if isinstance(call.checks, dict) else None
        reason = render.get("split_reason") if isinstance(render, dict) else None
        operation = "text_completion" if "prompt" in call.request and "messages" not in call.request else "chat"
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": call.model,
            "gen_ai.response.model": call.response.get("model") if isinstance(call.response, dict) else None,
            "gen_ai.response.id": call.response.get("id") if isinstance(call.response, dict) else None,
            "gen_ai.usage.input_tokens": len(call.prompt_ids),
            "gen_ai.usage.output_tokens": len(call.completion_ids),
            "gen_ai.response.finish_reasons": [call.finish_reason] if call.finish_reason else None,
            "gen_ai.request.temperature": _num(call.request.get("temperature")),
            "gen_ai.request.max_tokens": _int(
                call.request.get("max_tokens") or call.request.get("max_completion_tokens")
            ),
            "rl.call_id": call.call_id,
            "rl.call_seq": call.seq,
            "rl.attempt_id": call.attempt_id,
            "rl.rollout_id": call.rollout_id,
            "rl.group_id": group_id,
            "rl.split": split,
            "rl.policy_version": call.policy_version,
            "rl.is_policy": call.is_policy,
            "rl.token_source": call.token_source,
            "rl.split_reason": str(reason) if reason else None,
            "rl.failure": call.error,
        }
        self._emit_now(
            f"{operation} {call.model}",
            trace_id,
            call_span_id(call.call_id),
            parent=parent,
            start=call.started_at,
            end=call.ended_at,
            attributes=attrs,
            kind="client",
            error=call.error,
        )

    def reward(self, reward: Reward) -> None:
        """Keep a reward for its attempt's span (an event on it at the finish)."""
        kept = self._rewards.get(reward.attempt_id)
        if kept is None:
            self._rewards[reward.attempt_id] = kept = []
        kept.append(reward)

    def take_rewards(self, attempt_id: str) -> list[Reward]:
        """The rewards kept for the attempt (``reward``), handed over and forgotten."""
        return self._rewards.pop(attempt_id, [])

    def attempt(
        self,
        attempt_id: str,
        rollout_id: str,
        *,
        status: str,
        error: str | None,
        started_at: float | None,
        ended_at: float | None,
        calls: int | None = None,
        rewards: Sequence[Reward] | None = None,
        group_id: str | None = None,
        split: str | None = None,
    ) -> None:
        """The root span of a finished attempt, its rewards (given, or kept by ``reward``) and finish as events."""
        kept = self._rewards.pop(attempt_id, [])
        given = list(rewards) if rewards is not None else kept
        self._submit(
            functools.partial(
                self._attempt_span,
                attempt_id,
                rollout_id,
                status,
                error,
                started_at,
                ended_at,
                calls,
                given,
                group_id,
                split,
            )
        )

    def _attempt_span(
        self,
        attempt_id: str,
        rollout_id: str,
        status: str,
        error: str | None,
        started_at: float | None,
        ended_at: float | None,
        calls: int | None,
        given: list[Reward],
        group_id: str | None,
        split: str | None,
    ) -> None:
        finals = [r.value for r in given if r.call_id is None]
        events: list[tuple[str, float | None, Mapping[str, Any]]] = [
            ("rl.reward", r.created_at, {"rl.reward.name": r.name, "rl.reward.value": r.value, "rl.call_id": r.call_id})
            for r in given
        ]
        events.append(("rl.finish", ended_at, {"rl.status": status, "rl.failure": error}))
        self._emit_now(
            "rl.attempt",
            attempt_trace_id(attempt_id),
            attempt_span_id(attempt_id),
            parent=None,
            start=started_at if started_at is not None else ended_at,
            end=ended_at,
            attributes={
                "rl.attempt_id": attempt_id,
                "rl.rollout_id": rollout_id,
                "rl.group_id": group_id,
                "rl.split": split,
                "rl.status": status,
                "rl.reward": sum(finals) if finals else None,
                "rl.calls": calls,
                "rl.failure": error,
            },
            events=events,
            error=(error or status) if status != "succeeded" else None,
        )

    # -- the trainer's spans -----------------------------------------------------------------------------------
    def training_step(self, step: StepSpan) -> tuple[int, int]:
        """The step span, linked to the root span of every attempt it trained; returns its (trace id, span id)
        (the parent of the publication span)."""
        trace_id, span_id = (
            int.from_bytes(secrets.token_bytes(16), "big") | 1,
            int.from_bytes(secrets.token_bytes(8), "big") | 1,
        )
        adv = list(step.advantages)
        self._emit(
            "rl.step",
            trace_id,
            span_id,
            parent=None,
            start=step.started_at,
            end=step.ended_at,
            attributes={
                "rl.step": step.step,
                "rl.policy_version": step.version,
                "rl.loss": step.loss,
                "rl.records": step.records,
                "rl.groups": step.groups,
                "rl.attempts": len(step.attempt_ids),
                "rl.staleness_mean": step.staleness_mean,
                "rl.advantage.mean": sum(adv) / len(adv) if adv else None,
                "rl.advantage.min": min(adv) if adv else None,
                "rl.advantage.max": max(adv) if adv else None,
                "rl.advantage.abs_mean": sum(abs(a) for a in adv) / len(adv) if adv else None,
            },
            links=[
                (attempt_trace_id(a), attempt_span_id(a), {"rl.attempt_id": a}) for a in dict.fromkeys(step.attempt_ids)
            ],
        )
        return trace_id, span_id

    def publication(
        self, parent: tuple[int, int], *, step: int, version: int, started_at: float, ended_at: float
    ) -> None:
        """The weight publication after a step (a child of the step span)."""
        self._emit(
            "rl.publish",
            parent[0],
            int.from_bytes(secrets.token_bytes(8), "big") | 1,
            parent=parent,
            start=started_at,
            end=ended_at,
            attributes={"rl.step": step, "rl.policy_version": version},
        )

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Build what is queued and export everything; True when the exporter took it all in time."""
        deadline = time.monotonic() + timeout_s
        while (self._jobs or self._busy) and time.monotonic() < deadline:
            self._wake.set()
            time.sleep(0.001)  # the telemetry thread is building spans: a bounded wait on its queue
        left = max(0.0, deadline - time.monotonic())
        return not self._jobs and bool(self.processor.force_flush(int(left * 1000)))

    def shutdown(self) -> None:
        """Build and export what is queued, then stop the thread and the exporter."""
        self._stopping = True
        self._wake.set()
        self._thread.join(10)
        self.processor.shutdown()  # type: ignore[no-untyped-call]


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def _exporter(config: TelemetryConfig) -> Any:
    endpoint = config.otlp or ""
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        target = endpoint.split("://", 1)[1].rstrip("/")
        return GrpcExporter(endpoint=target, insecure=endpoint.startswith("http://"))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    url = endpoint.rstrip("/")
    return HttpExporter(endpoint=url if url.endswith("/v1/traces") else url + "/v1/traces")


def open_telemetry(config: TelemetryConfig | None = None) -> Telemetry | None:
    """The process's span exporter when telemetry is on (``config`` or the OTEL variables), else None. Raises
    ``ConfigError`` when it is asked for but the ``telemetry`` extra is not installed."""
    from lightning_sdk.errors import ConfigError

    resolved = (config or TelemetryConfig()).resolved()
    if resolved is None:
        return None
    try:
        tel = Telemetry(resolved)
    except ImportError as exc:
        raise ConfigError(
            f"telemetry export to {resolved.otlp} was asked for, but the OpenTelemetry SDK is not installed: "
            f"pip install 'lightning-rl-sdk[telemetry]' ({exc})"
        ) from None
    logger.info("exporting spans to %s (%s)", resolved.otlp, resolved.protocol)
    return tel
