"""OpenTelemetry traces of rollouts and training steps (off unless an OTLP endpoint is configured).

``open_telemetry`` gives the process's ``Telemetry`` (None when off); ``ids`` derives one trace per attempt from
its id (and the W3C ``traceparent`` the agent side propagates). See docs/telemetry.md.
"""

from lightning_sdk.telemetry.config import ENDPOINT_ENV, PROTOCOL_ENV, TelemetryConfig
from lightning_sdk.telemetry.ids import (
    attempt_span_id,
    attempt_trace_id,
    call_span_id,
    parse_traceparent,
    traceparent,
)
from lightning_sdk.telemetry.spans import StepSpan, Telemetry, open_telemetry

__all__ = [
    "ENDPOINT_ENV",
    "PROTOCOL_ENV",
    "StepSpan",
    "Telemetry",
    "TelemetryConfig",
    "attempt_span_id",
    "attempt_trace_id",
    "call_span_id",
    "open_telemetry",
    "parse_traceparent",
    "traceparent",
]
