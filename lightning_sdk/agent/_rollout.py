"""``@rollout``: turn an agent function ``(task, llm) -> reward | None`` into something workers can train.

The decorated object stays the user's function: ``agent(task, llm)`` calls it as plain code (an async agent
returns its coroutine). Workers call ``run_attempt``, which makes the attempt current (so ``emit_reward`` finds
it), applies the timeout and turns an exception into a failed attempt with its traceback.

Async agents run as an asyncio task on the worker's loop. Sync agents run on their own daemon thread (one per
attempt, inside a copied context): a sync function cannot be interrupted, so on timeout the attempt is failed and
the thread is abandoned; its attempt token stops working at once (the proxy answers 409), so it cannot leak calls
into another attempt, and a daemon thread never blocks the process from exiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any, overload

from lightning_sdk.agent._base import AttemptOutcome, format_exception, reward_value
from lightning_sdk.agent._context import AttemptContext, context_for
from lightning_sdk.agent._llm import LLM
from lightning_sdk.errors import ConfigError
from lightning_sdk.types import Task

__all__ = ["RolloutAgent", "rollout"]

AgentFn = Callable[[Task, LLM], Any]


class RolloutAgent:
    """A decorated agent function. Call it like the function; workers use ``run_attempt``."""

    def __init__(self, fn: AgentFn, *, timeout: float | None = None, max_attempts: int = 1) -> None:
        if not callable(fn):
            raise ConfigError(f"@rollout needs a function (task, llm) -> reward, got {fn!r}")
        if timeout is not None and timeout <= 0:
            raise ConfigError(f"@rollout timeout must be > 0 seconds, got {timeout}")
        if max_attempts < 1:
            raise ConfigError(f"@rollout max_attempts must be >= 1, got {max_attempts}")
        self.fn = fn
        self.timeout = timeout
        self.max_attempts = max_attempts
        self.is_async = inspect.iscoroutinefunction(fn)
        self.name = getattr(fn, "__qualname__", repr(fn))
        functools.update_wrapper(self, fn)

    def __call__(self, task: Task, llm: LLM) -> Any:
        return self.fn(task, llm)

    def __repr__(self) -> str:
        kind = "async " if self.is_async else ""
        return f"<rollout {kind}agent {self.name} timeout={self.timeout} max_attempts={self.max_attempts}>"

    async def run_attempt(self, ctx: AttemptContext, *, timeout: float | None) -> AttemptOutcome:
        """Run the function on ``ctx.task`` with ``ctx`` current; report success, failure or timeout."""
        try:
            if self.is_async:
                task = asyncio.get_running_loop().create_task(self.fn(ctx.task, ctx.llm), context=context_for(ctx))
                value = await asyncio.wait_for(task, timeout)
            else:
                value = await asyncio.wait_for(self._in_thread(ctx), timeout)
            return AttemptOutcome("succeeded", reward=reward_value(value, f"agent {self.name}"))
        except TimeoutError:
            return AttemptOutcome("timed_out", error=f"agent {self.name} timed out after {timeout} s")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return AttemptOutcome("failed", error=format_exception(exc))

    def _in_thread(self, ctx: AttemptContext) -> asyncio.Future[Any]:
        """Run the sync function on a fresh daemon thread; the future resolves on the calling loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        context = context_for(ctx)

        def settle(ok: bool, value: Any) -> None:
            if future.done():  # timed out or cancelled meanwhile
                return
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

        def target() -> None:
            try:
                value = context.run(self.fn, ctx.task, ctx.llm)
                result: tuple[bool, Any] = (True, value)
            except BaseException as exc:
                result = (False, exc)
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
                loop.call_soon_threadsafe(settle, *result)

        threading.Thread(target=target, name=f"agent-{ctx.attempt_id}", daemon=True).start()
        return future


@overload
def rollout(fn: AgentFn, /) -> RolloutAgent: ...


@overload
def rollout(*, timeout: float | None = None, max_attempts: int = 1) -> Callable[[AgentFn], RolloutAgent]: ...


def rollout(
    fn: AgentFn | None = None, /, *, timeout: float | None = None, max_attempts: int = 1
) -> RolloutAgent | Callable[[AgentFn], RolloutAgent]:
    """Make ``fn(task, llm) -> float | None`` (sync or async) a trainable agent.

    ``timeout`` (seconds) bounds each attempt; ``max_attempts`` is how many tries a rollout of this agent gets
    (a crash or timeout fails the attempt and the rollout is retried until then). Return the final reward, or
    call ``emit_reward`` and return None.
    """
    if fn is not None:
        return RolloutAgent(fn, timeout=timeout, max_attempts=max_attempts)

    def wrap(f: AgentFn) -> RolloutAgent:
        return RolloutAgent(f, timeout=timeout, max_attempts=max_attempts)

    return wrap
