"""The one retry helper: which errors retry, the backoff bounds, one level deep; and the passthrough proxy's POST
budget under it (a reply cut off mid-body counts against the same ``max_retries + 1`` POSTs, never their square)."""

from __future__ import annotations

import itertools
import logging
import time

import pytest

from lightning_sdk._retry import RetryPolicy, retry
from lightning_sdk.errors import UpstreamError
from lightning_sdk.proxy._backend import CallContext
from lightning_sdk.proxy.passthrough import PassthroughBackend, PassthroughConfig
from lightning_sdk.types import Attempt
from tests.support.mock_openai import MockOpenAI
from tests.support.servers import serve_async

FAST = RetryPolicy(retries=3, backoff_s=0.0, backoff_max_s=0.0)


class Flaky:
    """Fails with ``error`` on the first ``fails`` tries, then answers the try number."""

    def __init__(self, fails: int, error: Exception) -> None:
        self.fails, self.error, self.tries = fails, error, 0

    async def __call__(self) -> int:
        self.tries += 1
        if self.tries <= self.fails:
            raise self.error
        return self.tries


async def test_retries_accepted_errors_until_an_answer() -> None:
    fn = Flaky(2, ConnectionError("refused"))
    assert await retry(fn, policy=FAST, retry_if=lambda e: isinstance(e, ConnectionError), what="t") == 3
    assert fn.tries == 3


async def test_other_errors_are_not_retried() -> None:
    fn = Flaky(5, KeyError("final"))
    with pytest.raises(KeyError):
        await retry(fn, policy=FAST, retry_if=lambda e: isinstance(e, ConnectionError), what="t")
    assert fn.tries == 1


async def test_gives_up_after_retries_plus_one_tries_with_the_last_error() -> None:
    fn = Flaky(100, ConnectionError("refused"))
    with pytest.raises(ConnectionError, match="refused"):
        await retry(fn, policy=FAST, retry_if=lambda e: isinstance(e, ConnectionError), what="t")
    assert fn.tries == 4


async def test_one_level_a_nested_retry_makes_one_try_per_outer_try() -> None:
    inner = Flaky(100, ConnectionError("refused"))

    async def outer_try() -> int:
        return await retry(inner, policy=FAST, retry_if=lambda e: isinstance(e, ConnectionError), what="inner")

    with pytest.raises(ConnectionError):
        await retry(outer_try, policy=FAST, retry_if=lambda e: isinstance(e, ConnectionError), what="outer")
    assert inner.tries == 4  # 1 + 3 retries in all, not (1 + 3) ** 2
    # and once the outer retry is over, a retry is a full retry again
    again = Flaky(2, ConnectionError("refused"))
    assert await retry(again, policy=FAST, retry_if=lambda e: isinstance(e, ConnectionError), what="t") == 3


async def test_the_waits_between_tries_follow_the_backoff_from_the_first_retry_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The first try runs outside tenacity (no loop built for the common case); the waits after it are still the
    policy's delays for retries 1, 2, 3 in turn (not 1 again after the first), each logged with its number."""
    policy = RetryPolicy(retries=3, backoff_s=0.02, backoff_max_s=1.0)
    times: list[float] = []

    async def fails() -> int:
        times.append(time.monotonic())
        raise ConnectionError("refused")

    with caplog.at_level(logging.INFO, logger="lightning_sdk._retry"), pytest.raises(ConnectionError):
        await retry(fails, policy=policy, retry_if=lambda e: isinstance(e, ConnectionError), what="t")
    waits = [b - a for a, b in itertools.pairwise(times)]
    assert len(waits) == 3
    for n, wait in enumerate(waits, start=1):  # delay(n) lies in [0.5, 1.5) x 0.02 x 2**(n-1)
        assert 0.5 * 0.02 * 2 ** (n - 1) - 0.002 <= wait, (n, waits)
    assert waits[2] > waits[0]
    assert [m.split(";")[1].split(" in ")[0] for m in caplog.messages] == [" retry 1/3", " retry 2/3", " retry 3/3"]
    no_retries = Flaky(5, ConnectionError("refused"))
    with pytest.raises(ConnectionError):
        await retry(no_retries, policy=RetryPolicy(retries=0), retry_if=lambda e: True, what="t")
    assert no_retries.tries == 1


def test_backoff_is_exponential_capped_and_jittered() -> None:
    policy = RetryPolicy(retries=10, backoff_s=0.1, backoff_max_s=1.0)
    for n, base in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (9, 1.0)]:
        delays = [policy.delay(n) for _ in range(200)]
        assert all(0.5 * base <= d < 1.5 * base for d in delays)
        assert max(delays) - min(delays) > 0.2 * base  # jitter spreads clients that failed together


async def test_passthrough_cut_off_replies_share_one_budget_of_posts() -> None:
    mock = MockOpenAI()
    mock.fail_first, mock.fail_status = 2, 503  # two 503s,
    mock.drop_first = 100  # then every reply cut off mid-body
    async with serve_async(mock.app) as upstream:
        backend = PassthroughBackend(PassthroughConfig(upstream=f"{upstream.url}/v1", max_retries=3, backoff_s=0.0))
        body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
        try:
            with pytest.raises(UpstreamError, match="after 4 attempts") as info:
                attempt = Attempt(attempt_id="at-1", rollout_id="ro-1", index=0, token="tok")
                await backend.chat(body, CallContext(attempt=attempt, call_id="ca-1", seq=0, model="policy"))
        finally:
            await backend.aclose()
    assert info.value.status_code == 502
    assert mock.n_requests == 4  # one level of retries (nested, it was 6 here and up to 16 in general)
