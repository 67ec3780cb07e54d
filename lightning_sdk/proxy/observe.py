"""The proxy's observer seam: metrics, traces and other watchers hook into the call pipeline here.

A ``CallObserver`` is handed to the proxy as a list (``create_app(..., observers=[...])`` or ``Proxy(...,
observers=[...])``). The pipeline (``proxy/_call.py``) calls, for every request of an LLM route (chat completions,
completions, Responses, Messages, also under ``/t/<token>``):

* ``call_started(start)`` once, when the request arrives (before its body is read), with a ``CallStart``;
* ``call_ended(end)`` exactly once afterwards, with a ``CallEnd``: refused requests too (a bad body, a bad token:
  ``end.status`` 400/401/409..., ``end.call`` None), failed calls (recorded with their error: ``end.call`` is the
  recorded ``Call`` with ``Call.error``), and answered ones (``end.call`` the recorded call: prompt/completion ids,
  policy version, ``token_source``, ``finish_reason``, ``checks`` with the bridge's segment/split reason when the
  backend made one).

and, on the control routes, ``reward(event)`` for every recorded reward and ``finished(event)`` once an attempt is
ended through this proxy (``POST /lightning/v1/finish`` or the store route's finish).

Rules: observers run on the proxy's event loop, in the task that serves the request, so they must be quick and must
not block (queue work elsewhere); what an observer raises is logged and dropped (an observer never fails a call).
Because ``call_started`` and ``call_ended`` run in the serving task, an observer may set a ``contextvars`` value in
``call_started`` (e.g. a current span) that the backend's upstream request sees. With no observer nothing is
allocated: the pipeline checks the list once per request. ``CallObserver`` has no-op defaults, so an observer
subclasses it and overrides only what it needs. The events are read-only by contract (``CallStart`` and
``CallEnd`` are plain slotted dataclasses, not frozen ones: a frozen 12-field dataclass costs ~3.4 us to build
against ~0.5 us, and they are built for every call); ``CallStart`` compares by identity (use it as a key to pair a
start with its end: ``end.start is start``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from lightning_sdk.types import Call

if TYPE_CHECKING:
    from lightning_sdk.store import Store

__all__ = [
    "CallEnd",
    "CallObserver",
    "CallStart",
    "FinishEvent",
    "Mode",
    "RewardEvent",
    "notify_ended",
    "notify_finished",
    "notify_reward",
    "notify_started",
]

logger = logging.getLogger(__name__)

Mode = Literal["token", "passthrough", "external"]
"""How a call was served: the token-in/token-out backend, a passthrough engine, or an external provider (LiteLLM)."""


@dataclass(eq=False, slots=True)
class CallStart:
    """A request of an LLM route arrived (its body not read yet).

    ``surface``: the API (``chat.completions``, ``completions``, ``responses``, ``messages``); ``route``: the path
    as matched (``/v1/chat/completions``; a session route keeps its ``/t/{token}`` prefix, the token itself never
    appears); ``started_at``: wall-clock seconds (``lightning_sdk.types.now``, the clock of ``Call.started_at``);
    ``t0``: ``time.perf_counter()`` at arrival (for durations); ``traceparent``: the request's W3C ``traceparent``
    header as sent (None when absent; an instrumented harness sends it, and the call's span joins its span).
    """

    surface: str
    route: str
    started_at: float
    t0: float
    traceparent: str | None = None


@dataclass(eq=False, slots=True)
class CallEnd:
    """A request of an LLM route was answered (or refused, or cut off).

    ``status``: the HTTP status the agent got (200 for an answered or a started stream that was cut off later:
    then ``error_type``/``error_code`` say why; 499 when the agent hung up). ``error_type`` / ``error_code``: the
    error's OpenAI ``type`` and ``code`` (None when the call succeeded). ``mode``: None when the call was refused
    before a backend was chosen. ``attempt_id`` / ``rollout_id``: None when refused before the attempt was known.
    ``call``: the recorded ``Call`` (None when nothing was recorded: a refusal before the call had a ``seq``).
    ``model``: the model the request asked for (None when the body did not say). ``first_token_s``: seconds from
    arrival to the first streamed chunk (None unstreamed); ``duration_s``: arrival to the last byte.
    """

    start: CallStart
    status: int
    stream: bool
    mode: Mode | None
    model: str | None
    attempt_id: str | None
    rollout_id: str | None
    error_type: str | None
    error_code: str | None
    call: Call | None
    first_token_s: float | None
    duration_s: float

    @property
    def surface(self) -> str:
        return self.start.surface

    @property
    def route(self) -> str:
        return self.start.route


@dataclass(frozen=True, slots=True)
class RewardEvent:
    """A reward was accepted for recording (``call_id``: a per-call reward)."""

    attempt_id: str
    rollout_id: str
    name: str
    value: float
    call_id: str | None


@dataclass(frozen=True, slots=True)
class FinishEvent:
    """An attempt was ended through this proxy, after its calls and rewards were committed.

    ``status``: what the store recorded (``succeeded`` may have become ``failed`` when something could not be
    recorded: then ``error`` says why); ``calls`` / ``calls_failed``: the attempt's calls through this proxy.
    """

    attempt_id: str
    rollout_id: str
    status: str
    error: str | None
    calls: int
    calls_failed: int
    aborted: int


class CallObserver:
    """Watches the proxy's calls, rewards and finishes (see the module docstring); every method is a no-op here."""

    def attach(self, store: Store) -> None:
        """The proxy this observer watches serves from ``store`` (called once, when the proxy is built; an observer
        may read from it, e.g. a rollout's group and split, but never writes)."""

    def call_started(self, start: CallStart) -> None:
        """A request of an LLM route arrived."""

    def call_ended(self, end: CallEnd) -> None:
        """That request was answered, refused or cut off (exactly once per ``call_started``)."""

    def reward(self, event: RewardEvent) -> None:
        """A reward was accepted."""

    def finished(self, event: FinishEvent) -> None:
        """An attempt was ended."""


def notify_started(observers: tuple[CallObserver, ...], start: CallStart) -> None:
    for observer in observers:
        try:
            observer.call_started(start)
        except Exception:
            logger.exception("proxy observer %r failed in call_started", observer)


def notify_ended(observers: tuple[CallObserver, ...], end: CallEnd) -> None:
    for observer in observers:
        try:
            observer.call_ended(end)
        except Exception:
            logger.exception("proxy observer %r failed in call_ended", observer)


def notify_reward(observers: tuple[CallObserver, ...], event: RewardEvent) -> None:
    for observer in observers:
        try:
            observer.reward(event)
        except Exception:
            logger.exception("proxy observer %r failed in reward", observer)


def notify_finished(observers: tuple[CallObserver, ...], event: FinishEvent) -> None:
    for observer in observers:
        try:
            observer.finished(event)
        except Exception:
            logger.exception("proxy observer %r failed in finished", observer)
