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

import logging
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_sdk.telemetry.config import TelemetryConfig
from lightning_sdk.telemetry.ids import attempt_span_id, attempt_trace_id, call_span_id, parse_traceparent
from lightning_sdk.types import Attempt, Call, Reward

__all__ = ["StepSpan", "Telemetry", "open_telemetry"]

logger = logging.getLogger(__name__)

_SCOPE = "lightning_sdk"


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
        self._rewards: dict[str, list[Reward]] = {}  # running attempts' rewards, until their finish

    # -- building spans ----------------------------------------------------------------------------------------
    def _emit(
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
            events=[
                Event(n, {k: v for k, v in a.items() if v is not None}, timestamp=_ns(t)) for n, t, a in events
            ],
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
            "gen_ai.request.max_tokens": _int(call.request.get("max_tokens") or call.request.get("max_completion_tokens")),
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
        self._emit(
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
        self._rewards.setdefault(reward.attempt_id, []).append(reward)

    def attempt(
        self,
        attempt: Attempt,
        *,
        group_id: str | None = None,
        split: str | None = None,
        calls: int | None = None,
        rewards: Sequence[Reward] | None = None,
    ) -> None:
        """The root span of a finished attempt: its rewards and its finish as events."""
        kept = self._rewards.pop(attempt.attempt_id, [])
        given = list(rewards) if rewards is not None else kept
        finals = [r.value for r in given if r.call_id is None]
        events: list[tuple[str, float | None, Mapping[str, Any]]] = [
            ("rl.reward", r.created_at, {"rl.reward.name": r.name, "rl.reward.value": r.value, "rl.call_id": r.call_id})
            for r in given
        ]
        events.append(("rl.finish", attempt.ended_at, {"rl.status": attempt.status.value, "rl.failure": attempt.error}))
        failed = attempt.status.value != "succeeded"
        self._emit(
            "rl.attempt",
            attempt_trace_id(attempt.attempt_id),
            attempt_span_id(attempt.attempt_id),
            parent=None,
            start=attempt.started_at,
            end=attempt.ended_at,
            attributes={
                "rl.attempt_id": attempt.attempt_id,
                "rl.rollout_id": attempt.rollout_id,
                "rl.attempt_index": attempt.index,
                "rl.group_id": group_id,
                "rl.split": split,
                "rl.status": attempt.status.value,
                "rl.reward": sum(finals) if finals else None,
                "rl.calls": calls,
                "rl.failure": attempt.error,
            },
            events=events,
            error=(attempt.error or attempt.status.value) if failed else None,
        )

    # -- the trainer's spans -----------------------------------------------------------------------------------
    def training_step(self, step: StepSpan) -> tuple[int, int]:
        """The step span, linked to the root span of every attempt it trained; returns its (trace id, span id)
        (the parent of the publication span)."""
        trace_id, span_id = int.from_bytes(secrets.token_bytes(16), "big") | 1, int.from_bytes(secrets.token_bytes(8), "big") | 1
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

    def publication(self, parent: tuple[int, int], *, step: int, version: int, started_at: float, ended_at: float) -> None:
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
        return bool(self.processor.force_flush(int(timeout_s * 1000)))

    def shutdown(self) -> None:
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
