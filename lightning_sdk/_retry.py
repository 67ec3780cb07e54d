"""The one retry helper of lightning_sdk: which errors retry, how long to wait, and only one level deep.

Every place that talks to something that can be briefly away (the store over HTTP, the proxy's ``/reward`` and
``/finish``, the recorder's store writes, the engine behind the passthrough proxy) wraps *one try* in
``retry(...)`` instead of writing its own loop::

    resp = await retry(lambda: client.post(url), policy=RetryPolicy(retries=3), retry_if=is_connect_error,
                       what=f"POST {url}")

The policy:

- **which errors retry** is the caller's ``retry_if(exc)`` predicate: each caller knows which of its failures are
  transient (a refused connection, a 5xx, a locked store) and which are final (a 4xx, an unsafe-to-repeat request
  that may have reached the server). Anything else propagates at once. A try whose answer arrived but should be
  retried (a 5xx) raises ``TransientAnswer(answer)``, so the caller can still read the last answer.
- **backoff** is exponential with jitter: ``backoff_s * 2**i`` capped at ``backoff_max_s``, each wait drawn
  uniformly from ``[0.5, 1.5)`` times that, so clients that failed together do not retry together.
- **one level**: a ``retry`` running inside another ``retry`` (say the recorder's write retried over an
  ``HTTPStore`` that retries its own requests) makes a single try; the outermost loop owns the retrying, so a
  failure costs at most ``retries + 1`` tries, never their product.

When the tries are spent, the last error is raised unchanged; the caller translates it (``StoreUnavailableError``,
an OpenAI-shaped 502, ...). The first try runs as a plain ``await`` (the proxy's upstream calls and the recorder's
writes go through here: building a tenacity loop per call cost microseconds and left ~27 objects in reference
cycles for the garbage collector per call); the tries after a retryable failure run in ``tenacity.AsyncRetrying``.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt

from lightning_sdk.errors import LightningSDKError

__all__ = ["RetryPolicy", "TransientAnswer", "retry"]

logger = logging.getLogger(__name__)
T = TypeVar("T")
A = TypeVar("A")

_inside_retry: contextvars.ContextVar[bool] = contextvars.ContextVar("lightning_sdk_inside_retry", default=False)


@dataclass(frozen=True)
class RetryPolicy:
    """How many times to retry (after the first try) and how long to wait between tries."""

    retries: int = 5
    backoff_s: float = 0.1
    backoff_max_s: float = 5.0

    def delay(self, retry_number: int) -> float:
        """The wait before retry ``retry_number`` (1-based): exponential, capped, jittered to [0.5, 1.5)x."""
        base = min(self.backoff_max_s, self.backoff_s * 2.0 ** (retry_number - 1))
        return base * (0.5 + random.random())


class TransientAnswer(LightningSDKError, Generic[A]):
    """Raised by a try whose answer arrived but should be retried (a 5xx, a 429): carries the answer, so the caller
    can read the last one when the tries are spent."""

    def __init__(self, answer: A, reason: str) -> None:
        super().__init__(reason)
        self.answer = answer


async def retry(
    fn: Callable[[], Awaitable[T]],
    *,
    policy: RetryPolicy,
    retry_if: Callable[[BaseException], bool],
    what: str,
) -> T:
    """Await ``fn()`` until it returns, retrying the errors ``retry_if`` accepts (see the module docstring)."""
    if _inside_retry.get():  # one level: the enclosing retry owns the retrying
        return await fn()
    token = _inside_retry.set(True)
    try:
        try:  # the first try without the retry machinery: the common case builds nothing (hot paths call this)
            return await fn()
        except Exception as exc:
            if policy.retries == 0 or not retry_if(exc):
                raise
            wait = policy.delay(1)
            logger.info("%s: %r; retry 1/%d in %.2fs", what, exc, policy.retries, wait)
        await asyncio.sleep(wait)
        retrying = AsyncRetrying(  # the tries after the first: numbered from 2 for the backoff and the log
            stop=stop_after_attempt(policy.retries),
            wait=lambda state: policy.delay(state.attempt_number + 1),
            retry=retry_if_exception(retry_if),
            before_sleep=lambda state: _log(state, policy, what),
            reraise=True,
        )

        async def one_try() -> T:  # a coroutine function, which tenacity awaits (it calls a lambda synchronously)
            return await fn()

        return await retrying(one_try)
    finally:
        _inside_retry.reset(token)


def _log(state: RetryCallState, policy: RetryPolicy, what: str) -> None:
    exc = state.outcome.exception() if state.outcome is not None else None
    wait = state.next_action.sleep if state.next_action is not None else 0.0
    logger.info("%s: %r; retry %d/%d in %.2fs", what, exc, state.attempt_number + 1, policy.retries, wait)
