"""What a worker needs from any kind of agent: run one attempt and say how it went.

Two kinds implement it: ``RolloutAgent`` (a decorated Python function, sync or async) and ``CommandAgent`` (any
program, run as a subprocess). The worker treats both alike through ``run_attempt``.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from lightning_sdk.agent._context import AttemptContext

__all__ = ["Agent", "AttemptOutcome", "OutcomeStatus", "format_exception", "tail"]

OutcomeStatus = Literal["succeeded", "failed", "timed_out"]


@dataclass(frozen=True)
class AttemptOutcome:
    """How one attempt ended: ``reward`` is what the agent returned (None = none or emitted instead); ``error``
    holds the traceback or the program's stderr tail for a failed or timed-out attempt."""

    status: OutcomeStatus
    reward: float | None = None
    error: str | None = None
    output: str | None = None  # stdout tail of a command agent


@runtime_checkable
class Agent(Protocol):
    """An agent a worker can run. ``timeout`` (seconds, None = the worker's default) and ``max_attempts`` (tries
    per rollout when this agent's tasks are enqueued) are read by workers and trainers."""

    name: str
    timeout: float | None
    max_attempts: int

    async def run_attempt(self, ctx: AttemptContext, *, timeout: float | None) -> AttemptOutcome:
        """Run the agent on ``ctx.task`` against ``ctx.llm``; never raise for an agent failure (report it)."""
        ...


def format_exception(exc: BaseException) -> str:
    """A traceback as text (what a failed attempt stores as its error)."""
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()


def tail(text: str, n_chars: int = 4000) -> str:
    """The last ``n_chars`` characters of ``text`` (stderr/traceback tails kept on failed attempts)."""
    return text if len(text) <= n_chars else "…" + text[-n_chars:]


def reward_value(value: object, where: str) -> float | None:
    """Check an agent's return value: a number (the final reward) or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{where} returned {type(value).__name__} {value!r}; return a float reward or None")
    return float(value)
