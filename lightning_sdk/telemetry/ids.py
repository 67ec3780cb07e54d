"""Trace ids every process agrees on without talking: one trace per attempt, its root span id, from the attempt id.

The proxy (call spans, the attempt span), the trainer (the step span's links) and the agent side (the W3C
``traceparent`` it hands to the harness) all derive the same ids from ``attempt_id``, so an attempt's spans join one
trace whichever process sent them, and a training step links to the attempts it trained by id alone. Pure: no
OpenTelemetry import (the agent side propagates the context even where the SDK is not installed).
"""

from __future__ import annotations

import hashlib
import re

__all__ = ["attempt_span_id", "attempt_trace_id", "call_span_id", "parse_traceparent", "traceparent"]

_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def _digest(kind: str, key: str) -> bytes:
    return hashlib.sha256(f"lightning-sdk/{kind}/{key}".encode()).digest()


def _nonzero(value: int) -> int:
    return value or 1  # all-zero ids are invalid in W3C trace context


def attempt_trace_id(attempt_id: str) -> int:
    """The 128-bit trace id of ``attempt_id``'s trace."""
    return _nonzero(int.from_bytes(_digest("trace", attempt_id)[:16], "big"))


def attempt_span_id(attempt_id: str) -> int:
    """The 64-bit id of the attempt's root span (the parent of its calls' spans)."""
    return _nonzero(int.from_bytes(_digest("attempt", attempt_id)[:8], "big"))


def call_span_id(call_id: str) -> int:
    """The 64-bit id of a call's span."""
    return _nonzero(int.from_bytes(_digest("call", call_id)[:8], "big"))


def traceparent(attempt_id: str) -> str:
    """The W3C ``traceparent`` of the attempt's root span (sampled): what the agent side hands to the harness."""
    return f"00-{attempt_trace_id(attempt_id):032x}-{attempt_span_id(attempt_id):016x}-01"


def parse_traceparent(value: str | None) -> tuple[int, int] | None:
    """(trace id, span id) of a W3C ``traceparent`` header; None when absent or malformed (never raises)."""
    if not value:
        return None
    match = _TRACEPARENT.match(value.strip().lower())
    if match is None:
        return None
    trace_id, span_id = int(match.group(1), 16), int(match.group(2), 16)
    return (trace_id, span_id) if trace_id and span_id else None
