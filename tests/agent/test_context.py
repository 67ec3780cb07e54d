"""emit_reward finds its attempt from the agent body, its asyncio tasks, the threads it starts with ``la.Thread`` /
``la.ContextExecutor`` or with ``attempt=`` passed explicitly — records nothing outside training, and patches
nothing in ``threading``. Runs real agents through ``RolloutAgent.run_attempt`` (no server needed: rewards are
buffered on the attempt until the worker writes them)."""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest

import lightning_sdk.agent as la
from lightning_sdk.agent._context import AttemptContext
from lightning_sdk.errors import AttemptNotRunningError, LightningSDKError

LLM = la.LLM(base_url="http://127.0.0.1:9/v1", api_key="tok", model="policy")


def _ctx(i: int) -> AttemptContext:
    return AttemptContext(f"at-{i}", f"ro-{i}", {"i": i}, LLM)


async def _run(agent: la.RolloutAgent, ctx: AttemptContext) -> la.AttemptOutcome:
    return await agent.run_attempt(ctx, timeout=10)


def test_outside_training_records_nothing_and_agent_is_plain_code() -> None:
    @la.rollout
    def agent(task: dict[str, int], llm: la.LLM) -> float:
        la.emit_reward(0.5)  # no attempt anywhere: a no-op
        return task["x"] * 2.0

    assert agent({"x": 3}, LLM) == 6.0
    assert la.current_attempt() is None


async def test_sync_agent_threads_started_inside_each_attempt_report_to_their_own_attempt() -> None:
    """Two sync attempts run at the same time; each starts a ``la.Thread``, submits to a ``la.ContextExecutor``
    shared by both, and hands ``attempt=`` to a plain thread. Both attempts are running, so only real context
    propagation can attribute them correctly."""
    both_running = threading.Barrier(2, timeout=10)
    shared = la.ContextExecutor(2)

    @la.rollout
    def agent(task: dict[str, int], llm: la.LLM) -> None:
        both_running.wait()
        t = la.Thread(target=lambda: la.emit_reward(float(task["i"]), name="from_thread"))
        t.start()
        t.join()
        shared.submit(la.emit_reward, 10.0 + task["i"], "from_pool").result()
        mine = la.current_attempt()
        plain = threading.Thread(target=lambda: la.emit_reward(20.0 + task["i"], "explicit", attempt=mine))
        plain.start()
        plain.join()
        la.emit_reward(100.0 + task["i"])

    ctxs = [_ctx(1), _ctx(2)]
    try:
        outcomes = await asyncio.gather(*(_run(agent, c) for c in ctxs))
    finally:
        shared.shutdown()
    assert [o.status for o in outcomes] == ["succeeded", "succeeded"]
    for c in ctxs:
        i = c.task["i"]
        got = sorted((r.name, r.value) for r in c.close())
        assert got == [
            ("explicit", 20.0 + i),
            ("from_pool", 10.0 + i),
            ("from_thread", float(i)),
            ("reward", 100.0 + i),
        ]


async def test_a_plain_thread_has_no_attempt_records_nothing_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    """Nothing in ``threading`` is patched: a plain thread starts with an empty context, so its reward is not
    guessed onto some running attempt; it is dropped with a warning that says how to propagate the attempt."""
    start = threading.Thread.start

    @la.rollout
    def agent(task: dict[str, int], llm: la.LLM) -> None:
        t = threading.Thread(target=la.emit_reward, args=(5.0,), name="plain-worker")
        t.start()
        t.join()

    c = _ctx(8)
    assert (await _run(agent, c)).status == "succeeded"
    assert c.close() == []
    assert threading.Thread.start is start
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "plain-worker" in warning and "lightning_sdk.agent.Thread" in warning and "nothing recorded" in warning


async def test_async_agent_tasks_and_to_thread_report_to_their_own_attempt() -> None:
    @la.rollout(timeout=5, max_attempts=3)
    async def agent(task: dict[str, int], llm: la.LLM) -> float:
        async def child() -> None:
            await asyncio.sleep(0.01)
            la.emit_reward(1.0 * task["i"], name="task", call_id=f"call-{task['i']}")

        await asyncio.gather(asyncio.create_task(child()), asyncio.to_thread(la.emit_reward, 2.0 * task["i"], "thread"))
        return 0.25

    assert agent.max_attempts == 3 and agent.timeout == 5 and agent.is_async
    ctxs = [_ctx(3), _ctx(4)]
    outcomes = await asyncio.gather(*(_run(agent, c) for c in ctxs))
    assert [(o.status, o.reward) for o in outcomes] == [("succeeded", 0.25), ("succeeded", 0.25)]
    for c in ctxs:
        i = c.task["i"]
        got = sorted((r.name, r.value, r.call_id) for r in c.close())
        assert got == [("task", 1.0 * i, f"call-{i}"), ("thread", 2.0 * i, None)]


async def test_no_guessing_from_an_empty_context_only_explicit_attempts() -> None:
    a = _ctx(5)
    empty = contextvars.Context()  # a context that never saw any attempt
    empty.run(la.emit_reward, 0.5)  # no process-wide "the only running attempt" to fall back on
    empty.run(la.emit_reward, 0.75, attempt=a)
    assert [(r.name, r.value) for r in a.close()] == [("reward", 0.75)]


def test_reward_after_the_attempt_ended_and_bad_values_raise() -> None:
    c = _ctx(7)
    c.close()
    with pytest.raises(AttemptNotRunningError):
        la.emit_reward(1.0, attempt=c)
    with pytest.raises(LightningSDKError, match="finite"):
        la.emit_reward(float("nan"))
    with pytest.raises(LightningSDKError, match="number"):
        la.emit_reward("high")  # type: ignore[arg-type]
