"""The proxy's hot-path shortcuts give exactly what the slow forms gave.

``Call.from_checked`` (no pydantic validation for fields the passthrough checked) must equal the validated ``Call``
field for field and in its stored row; the token-id check that reads the list's JSON must refuse every item the
type-by-type check refused; ``HangUpSweeper`` arms each due watch (one timer for many) and never a closed one.
Real components: the real ``Call`` model and SQLite row builder, a real vLLM-shaped answer from ``MockOpenAI``, a
real asyncio event loop.
"""

from __future__ import annotations

import asyncio
import gc
import http.client
import itertools
import random
from typing import Any

import orjson
import pytest
from starlette.testclient import TestClient

from lightning_sdk.errors import ConfigError
from lightning_sdk.proxy._hangup import HangUpSweeper, HangUpWatch
from lightning_sdk.proxy._shapes import MAX_TOKEN_ID, MalformedAnswer, _ids, canonical_chat, chat_tokens
from lightning_sdk.store._sqlite_rows import call_to_row
from lightning_sdk.types import Call
from tests.support.mock_openai import MockOpenAI
from tests.support.proxy import ProxyHandle
from tests.support.waiting import until_async


def _engine_answer() -> dict[str, Any]:
    """A chat answer with ids and log-probs as the mock engine (vLLM's wire format) sends it."""
    body = {"model": "policy", "messages": [{"role": "user", "content": "2 + 2?"}], "max_tokens": 16}
    with TestClient(MockOpenAI(record_requests=False).app) as client:
        r = client.post("/v1/chat/completions", json={**body, "return_token_ids": True, "logprobs": True})
    assert r.status_code == 200
    answer: dict[str, Any] = r.json()
    return answer


def _fields(answer: dict[str, Any]) -> dict[str, Any]:
    tok = chat_tokens(answer)
    return {
        "call_id": "call-1",
        "attempt_id": "at-1",
        "rollout_id": "ro-1",
        "seq": 2,
        "model": "policy",
        "request": {"model": "policy", "messages": [{"role": "user", "content": "2 + 2?"}]},
        "started_at": 1700000000.25,
        "ended_at": 1700000001.5,
        "error": None,
        "is_policy": True,
        "token_source": "engine",
        "response": canonical_chat(answer),
        "prompt_ids": tok.prompt_ids,
        "completion_ids": tok.completion_ids,
        "logprobs": tok.logprobs,
        "policy_version": 3,
        "finish_reason": tok.finish_reason,
        "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9},
        "checks": {},
        "idempotency_key": "key-1",
    }


def test_from_checked_equals_the_validated_call_and_its_row() -> None:
    fields = _fields(_engine_answer())
    assert fields["prompt_ids"] and fields["logprobs"]
    fast, slow = Call.from_checked(**dict(fields)), Call(**fields)
    assert fast == slow
    assert fast.model_dump() == slow.model_dump()
    assert fast.model_dump_json() == slow.model_dump_json()
    assert call_to_row(fast) == call_to_row(slow)
    row = call_to_row(slow)
    blobs = ("prompt_ids", "completion_ids", "logprobs")
    assert orjson.loads(row[-1]) == {k: v for k, v in slow.model_dump().items() if k not in blobs}
    assert list(orjson.loads(row[-1])) == [k for k in Call.model_fields if k not in blobs]  # declaration order
    assert Call.model_validate_json(fast.model_dump_json()) == slow
    fast.error = "later"  # the proxy sets the error of a failed call after building it
    assert fast.error == "later" and fast.model_dump()["error"] == "later"


def test_a_row_that_cannot_be_packed_names_its_list() -> None:
    fields = _fields(_engine_answer())
    fields["completion_ids"] = [1, 2**40]  # what only an unchecked Call could hold
    with pytest.raises(ConfigError, match="call call-1 completion_ids"):
        call_to_row(Call.from_checked(**fields))


def test_from_checked_needs_every_field() -> None:
    fields = _fields(_engine_answer())
    del fields["checks"]
    with pytest.raises(TypeError, match="checks"):
        Call.from_checked(**fields)
    with pytest.raises(TypeError, match="extra"):
        Call.from_checked(**_fields(_engine_answer()), extra=1)


@pytest.mark.parametrize(
    "bad",
    [
        [1, True],
        [False],
        [1, 2.0],
        [1e5],
        [-1],
        [0, MAX_TOKEN_ID + 1],
        [2**63],
        [2**70],
        [None],
        ["7"],
        [[1, 2], 3],
        [{"id": 1}],
        [float("nan")],
    ],
)
def test_the_token_id_check_refuses_what_the_type_check_refused(bad: list[Any]) -> None:
    with pytest.raises(MalformedAnswer, match="is not a token id"):
        _ids(bad, "ids")
    # the same after a JSON round trip, where it can be made (what an engine's answer becomes)
    try:
        parsed = orjson.loads(orjson.dumps(bad))
    except TypeError:
        return
    with pytest.raises(MalformedAnswer):
        _ids(parsed, "ids")


def test_the_token_id_check_accepts_every_token_id_unchanged() -> None:
    rng = random.Random(0)
    ids = [0, 1, 9, 10, MAX_TOKEN_ID] + [rng.randrange(0, MAX_TOKEN_ID) for _ in range(2000)]
    assert _ids(ids, "ids") is ids
    assert _ids([], "ids") == []
    assert _ids(None, "ids") is None


def test_the_sweeper_arms_due_watches_with_one_timer_and_never_a_closed_one() -> None:
    """Each watch records the loop time it was armed at, so "not armed before ``after_s``" is checked on the loop's
    clock (a loaded machine that runs the timer late cannot make it fail, as a sleep before looking did)."""

    async def main() -> tuple[list[int], list[float], list[float], float]:
        armed: list[int] = []
        armed_at: list[float] = []
        loop = asyncio.get_running_loop()
        timers: list[float] = []
        call_at = loop.call_at

        def counting_call_at(when: float, callback: Any, *args: Any, **kw: Any) -> asyncio.TimerHandle:
            if callback == sweeper._sweep:
                timers.append(when)
            return call_at(when, callback, *args, **kw)

        sweeper = HangUpSweeper(0.2)
        loop.call_at = counting_call_at  # type: ignore[method-assign]

        def receive_for(i: int) -> Any:
            def receive() -> asyncio.Future[dict[str, Any]]:  # called when the watch is armed
                armed.append(i)
                armed_at.append(loop.time())
                return loop.create_future()  # the agent never hangs up

            return receive

        task = asyncio.current_task()
        t0 = loop.time()
        watches = [HangUpWatch(receive_for(i), task, sweeper) for i in range(100)]
        for w in watches[::2]:
            w.close()  # calls that ended before their watch was due
        assert armed == []  # none at the start of its call
        await until_async(lambda: len(armed) >= 50, timeout=10, what="the open watches to be armed")
        for w in watches:
            w.close()
        return armed, armed_at, timers, t0

    armed, armed_at, timers, t0 = asyncio.run(main())
    assert sorted(armed) == list(range(1, 100, 2))  # every open watch, no closed one
    assert min(armed_at) >= t0 + 0.2  # none before its call had run ``after_s``
    # one timer for 100 calls started together, set again (no sooner than ``tick_s``) only for the ones whose start
    # came after the first sweep's clock reading (100 starts can span that on a loaded machine)
    assert timers[0] >= t0 + 0.2 and len(timers) <= 2
    assert all(b - a >= 0.05 - 1e-9 for a, b in itertools.pairwise(timers))


def test_a_watch_without_a_sweeper_is_armed_at_once() -> None:
    async def main() -> bool:
        seen = asyncio.Event()

        async def receive() -> dict[str, Any]:
            seen.set()
            return {"type": "http.request"}

        watch = HangUpWatch(receive, asyncio.current_task(), None)
        await asyncio.wait_for(seen.wait(), 1.0)
        watch.close()
        return seen.is_set()

    assert asyncio.run(main())


def test_calls_leave_almost_no_cyclic_garbage(px: ProxyHandle) -> None:
    """``serve`` runs the young collection every ``GC_GEN0_THRESHOLD`` (50,000) net allocations, which is safe only
    because a call leaves (almost) nothing that reference counting cannot free: with automatic collection off, 300
    chat completions through the real proxy on loopback (a keep-alive ``http.client`` connection in this process,
    which leaves none of its own) leave fewer than 100 unreachable objects in all for the collector. A cycle made per
    call or per recorder write (an exception kept with its traceback, a task that refers to itself, a retry loop
    built for each write: ~27 objects each, found this way) leaves hundreds or thousands."""
    from lightning_sdk.proxy.serve import GC_GEN0_THRESHOLD

    assert GC_GEN0_THRESHOLD == 50_000
    session = px.session()
    body = orjson.dumps({"model": "policy", "messages": [{"role": "user", "content": "What is 2 + 2?"}]})
    headers = {"Authorization": f"Bearer {session['token']}", "Content-Type": "application/json"}
    conn = http.client.HTTPConnection(px.server.host, px.server.port)

    def call() -> None:
        try:
            conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
            response = conn.getresponse()
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            # the server closed the idle keep-alive connection (uvicorn's 5 s keep-alive: a loaded machine's
            # drain and collection can take longer); the next request opens a new one
            conn.close()
            conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
            response = conn.getresponse()
        assert response.status == 200 and orjson.loads(response.read())["choices"]

    try:
        for _ in range(20):  # warm-up: connections, caches
            call()
        px.drain()
        gc.collect()
        gc.disable()
        try:
            for _ in range(300):
                call()
            px.drain()
            unreachable = gc.collect()
        finally:
            gc.enable()
    finally:
        conn.close()
    assert unreachable < 100, unreachable  # 6 measured; 4,110 while each recorder write built a tenacity loop
