"""The running attempt as context, so ``emit_reward`` works anywhere inside an agent.

``emit_reward(value)`` has to find the attempt it belongs to without the user passing it around. The worker makes
the attempt current in a ``contextvars.ContextVar`` before it calls the agent, which covers:

* async agents and every asyncio task they create (tasks copy the context of their creator);
* sync agents, which the worker runs in a thread inside ``contextvars.copy_context()``;
* ``asyncio.to_thread`` (it copies the context) and ``loop.run_in_executor`` with a copied context;
* threads the agent starts with ``lightning_sdk.agent.Thread`` (a ``threading.Thread`` that runs in a copy of the
  context that started it) and work submitted to ``lightning_sdk.agent.ContextExecutor`` (a ``ThreadPoolExecutor``
  that runs each call in a copy of the submitter's context);
* anything else, explicitly: ``attempt = current_attempt()`` in the agent, then ``emit_reward(v, attempt=attempt)``
  from wherever the work runs.

Nothing is patched: a plain ``threading.Thread`` starts with an empty context on Python 3.11-3.13, so a reward
emitted there has no attempt. ``emit_reward`` then records nothing and logs a warning naming the two ways above
(from the main thread of plain code, outside training, it is a silent no-op as before). There is no process-wide
registry of running attempts to guess from.

Rewards are buffered on the attempt and written by the worker when the agent returns, before the attempt is
finished, so they are committed inside the durability barrier and never cross threads or event loops.
"""

from __future__ import annotations

import contextvars
import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

from lightning_sdk.agent._llm import LLM
from lightning_sdk.errors import AttemptNotRunningError, LightningSDKError
from lightning_sdk.types import Task

__all__ = ["AttemptContext", "ContextExecutor", "EmittedReward", "Thread", "current_attempt", "emit_reward"]

logger = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True)
class EmittedReward:
    """A reward emitted by the agent: final when ``call_id`` is None, else for that call."""

    value: float
    name: str = "reward"
    call_id: str | None = None


@dataclass
class AttemptContext:
    """What an agent run knows about its attempt: ids, task, endpoint, and the rewards it emitted."""

    attempt_id: str
    rollout_id: str
    task: Task
    llm: LLM
    server_url: str | None = None  # the proxy/daemon root (no /v1), for the reward endpoint of command agents
    rewards: list[EmittedReward] = field(default_factory=list)

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _closed: bool = field(default=False, repr=False)

    @property
    def traceparent(self) -> str:
        """The W3C ``traceparent`` of this attempt's trace (send it as a header to join the trace by hand)."""
        from lightning_sdk.telemetry.ids import traceparent

        return traceparent(self.attempt_id)

    def add_reward(self, reward: EmittedReward) -> None:
        with self._lock:
            if self._closed:
                raise AttemptNotRunningError(
                    f"attempt {self.attempt_id} has already ended; a reward emitted after the agent returned is lost"
                )
            self.rewards.append(reward)

    def close(self) -> list[EmittedReward]:
        """Stop accepting rewards; return those emitted (the worker writes them)."""
        with self._lock:
            self._closed = True
            return list(self.rewards)


_current: contextvars.ContextVar[AttemptContext | None] = contextvars.ContextVar("lightning_attempt", default=None)


class Thread(threading.Thread):
    """A ``threading.Thread`` that runs in a copy of the context that called ``start()``: started inside an attempt,
    its ``emit_reward`` calls go to that attempt."""

    _context: contextvars.Context | None = None

    def start(self) -> None:
        self._context = contextvars.copy_context()
        super().start()

    def run(self) -> None:
        if self._context is None:  # pragma: no cover - start() always sets it
            super().run()
        else:
            self._context.run(super().run)


class ContextExecutor(ThreadPoolExecutor):
    """A ``ThreadPoolExecutor`` whose ``submit`` runs each call in a copy of the submitter's context (also ``map``,
    which submits): work submitted inside an attempt reports to that attempt, even on a pool shared by many."""

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        return super().submit(contextvars.copy_context().run, fn, *args, **kwargs)  # type: ignore[arg-type]


def context_for(ctx: AttemptContext) -> contextvars.Context:
    """A copy of the caller's context with ``ctx`` current: run the agent (or a task) inside it."""
    context = contextvars.copy_context()
    context.run(_current.set, ctx)
    context.run(_join_trace, ctx.attempt_id)
    return context


def _join_trace(attempt_id: str) -> None:
    """Make the attempt's span the current OpenTelemetry span of the agent's context (when the OpenTelemetry API
    is installed), so a harness that is instrumented itself (LangChain, the OpenAI Agents SDK with an OTel
    processor) starts its spans inside the attempt's trace: the trace the proxy's call spans are in (W3C trace
    context; the ids come from ``lightning_sdk.telemetry.ids``). Without the API: nothing to join, nothing done."""
    try:
        from opentelemetry import context as otel_context
        from opentelemetry import trace
    except ImportError:
        return
    from lightning_sdk.telemetry.ids import attempt_span_id, attempt_trace_id

    span = trace.NonRecordingSpan(
        trace.SpanContext(
            attempt_trace_id(attempt_id),
            attempt_span_id(attempt_id),
            is_remote=True,
            trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED),
        )
    )
    otel_context.attach(trace.set_span_in_context(span))


def current_attempt() -> AttemptContext | None:
    """The attempt the calling code runs under, or None (outside training, or a thread that did not inherit the
    context: see the module docstring)."""
    return _current.get()


def emit_reward(
    value: float, name: str | None = None, call_id: str | None = None, *, attempt: AttemptContext | None = None
) -> None:
    """Give the current attempt (or ``attempt``) a reward: final (``call_id=None``) or for one call (its ``call_id``).

    Works from the agent function, asyncio tasks it creates, ``Thread`` / ``ContextExecutor`` work it starts, and
    anywhere with ``attempt=current_attempt()`` taken in the agent. Outside training (the agent run as plain code)
    nothing is recorded. The value must be a finite number. A call's id is the
    ``X-Lightning-Call-Id`` header of its response (openai: ``client.chat.completions.with_raw_response.create(...)
    .headers["x-lightning-call-id"]``); an id that is not a call of this attempt is refused by the proxy (400).
    """
    try:
        v = float(value)
    except (TypeError, ValueError) as exc:
        raise LightningSDKError(f"emit_reward needs a number, got {value!r}") from exc
    if not math.isfinite(v):
        raise LightningSDKError(f"emit_reward needs a finite number, got {v}")
    ctx = attempt if attempt is not None else current_attempt()
    if ctx is None:
        if threading.current_thread() is threading.main_thread():
            logger.debug("emit_reward(%s) outside training: nothing recorded", v)
        else:
            logger.warning(
                "emit_reward(%s) from thread %r, which has no attempt in its context: nothing recorded. Start it "
                "with lightning_sdk.agent.Thread / ContextExecutor, or pass attempt=current_attempt() taken in "
                "the agent",
                v,
                threading.current_thread().name,
            )
        return
    ctx.add_reward(EmittedReward(value=v, name=name or "reward", call_id=call_id))
