"""The running attempt as ambient context, so ``emit_reward`` works anywhere inside an agent.

``emit_reward(value)`` has to find the attempt it belongs to without the user passing it around. The worker makes
the attempt current in a ``contextvars.ContextVar`` before it calls the agent, which covers:

* async agents and every asyncio task they create (tasks copy the context of their creator);
* sync agents, which the worker runs in a thread inside ``contextvars.copy_context()``;
* ``asyncio.to_thread`` / ``loop.run_in_executor`` calls made with a copied context;
* plain ``threading.Thread`` objects the agent starts itself: Python 3.11-3.13 threads begin with an empty context,
  so the first time an attempt becomes current this module wraps ``threading.Thread.start`` (once per process):
  a thread started while an attempt is current runs with that attempt current. Threads started elsewhere are
  untouched. (A pool thread keeps the attempt of whoever started it: submit to a long-lived executor with
  ``contextvars.copy_context().run`` to be exact.)

When no attempt is current in the calling context but exactly one attempt is running in the process, that one is
used (one attempt per process is the common case of a command agent or a single worker). With several running and
none current, ``emit_reward`` raises rather than guess. With none running at all (the agent called as plain code)
it records nothing.

Rewards are buffered on the attempt and written by the worker when the agent returns, before the attempt is
finished, so they are committed inside the durability barrier and never cross threads or event loops.
"""

from __future__ import annotations

import contextvars
import logging
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from lightning_sdk.agent._llm import LLM
from lightning_sdk.errors import AttemptNotRunningError, LightningSDKError
from lightning_sdk.types import Task

__all__ = ["AttemptContext", "EmittedReward", "current_attempt", "emit_reward"]

logger = logging.getLogger(__name__)


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


class _Running:
    """Every attempt running in this process (the fallback for contexts that lost the ContextVar)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[str, AttemptContext] = {}

    def add(self, ctx: AttemptContext) -> None:
        with self._lock:
            self._by_id[ctx.attempt_id] = ctx

    def remove(self, ctx: AttemptContext) -> None:
        with self._lock:
            self._by_id.pop(ctx.attempt_id, None)

    def snapshot(self) -> list[AttemptContext]:
        with self._lock:
            return list(self._by_id.values())


_RUNNING = _Running()
_hook_lock = threading.Lock()
_hook_installed = False


def _install_thread_hook() -> None:
    """Make threads started inside an attempt run with that attempt current (see the module docstring)."""
    global _hook_installed
    with _hook_lock:
        if _hook_installed:
            return
        original_start: Callable[[threading.Thread], None] = threading.Thread.start

        def start(self: threading.Thread) -> None:
            attempt = _current.get()
            if attempt is not None:
                inner = self.run

                def run() -> None:
                    _current.set(attempt)
                    inner()

                self.run = run  # type: ignore[method-assign]
            original_start(self)

        threading.Thread.start = start  # type: ignore[method-assign]
        _hook_installed = True


@contextmanager
def running_attempt(ctx: AttemptContext) -> Iterator[None]:
    """Register ``ctx`` as running in this process for the duration (the worker wraps each attempt in this)."""
    _install_thread_hook()
    _RUNNING.add(ctx)
    try:
        yield
    finally:
        _RUNNING.remove(ctx)


def context_for(ctx: AttemptContext) -> contextvars.Context:
    """A copy of the caller's context with ``ctx`` current: run the agent (or a task) inside it."""
    context = contextvars.copy_context()
    context.run(_current.set, ctx)
    return context


def current_attempt() -> AttemptContext | None:
    """The attempt the calling code runs under, or None outside training (see the module docstring)."""
    ctx = _current.get()
    if ctx is not None:
        return ctx
    running = _RUNNING.snapshot()
    if len(running) == 1:
        return running[0]
    if running:
        raise LightningSDKError(
            f"{len(running)} attempts are running in this process and none is current here, so this reward cannot "
            "be attributed: start threads inside the agent (they inherit its attempt) or submit work with "
            "contextvars.copy_context().run(...)"
        )
    return None


def emit_reward(value: float, name: str | None = None, call_id: str | None = None) -> None:
    """Give the current attempt a reward: final (``call_id=None``) or for one call (its ``call_id``).

    Works from the agent function, threads it starts and asyncio tasks it creates. Outside training (the agent run
    as plain code) nothing is recorded. The value must be a finite number. A call's id is the
    ``X-Lightning-Call-Id`` header of its response (openai: ``client.chat.completions.with_raw_response.create(...)
    .headers["x-lightning-call-id"]``); an id that is not a call of this attempt is refused by the proxy (400).
    """
    try:
        v = float(value)
    except (TypeError, ValueError) as exc:
        raise LightningSDKError(f"emit_reward needs a number, got {value!r}") from exc
    if not math.isfinite(v):
        raise LightningSDKError(f"emit_reward needs a finite number, got {v}")
    ctx = current_attempt()
    if ctx is None:
        logger.debug("emit_reward(%s) outside training: nothing recorded", v)
        return
    ctx.add_reward(EmittedReward(value=v, name=name or "reward", call_id=call_id))
