"""emit_reward finds its attempt from the agent body, its threads, its asyncio tasks — and records nothing outside
training. Runs real agents through ``RolloutAgent.run_attempt`` (no server needed: rewards are buffered on the
attempt until the worker writes them)."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

import lightning_sdk.agent as la
from lightning_sdk.agent._context import AttemptContext, running_attempt
from lightning_sdk.errors import AttemptNotRunningError, LightningSDKError

LLM = la.LLM(base_url="http://127.0.0.1:9/v1", api_key="tok", model="policy")


def _ctx(i: int) -> AttemptContext:
    return AttemptContext(f"at-{i}", f"ro-{i}", {"i": i}, LLM)


async def _run(agent: la.RolloutAgent, ctx: AttemptContext) -> la.AttemptOutcome:
    with running_attempt(ctx):
        return await agent.run_attempt(ctx, timeout=10)


def test_outside_training_records_nothing_and_agent_is_plain_code() -> None:
    @la.rollout
    def agent(task: dict[str, int], llm: la.LLM) -> float:
        la.emit_reward(0.5)  # no attempt anywhere: a no-op
        return task["x"] * 2.0

    assert agent({"x": 3}, LLM) == 6.0
    assert la.current_attempt() is None


async def test_sync_agent_threads_started_inside_each_attempt_report_to_their_own_attempt() -> None:
    """Two sync attempts run at the same time; each starts a plain threading.Thread (and a ThreadPoolExecutor) that
    emits a reward. Both attempts are running, so only real context propagation can attribute them correctly."""
    both_running = threading.Barrier(2, timeout=10)

    @la.rollout
    def agent(task: dict[str, int], llm: la.LLM) -> None:
        both_running.wait()
        t = threading.Thread(target=lambda: la.emit_reward(float(task["i"]), name="from_thread"))
        t.start()
        t.join()
        with ThreadPoolExecutor(1) as ex:
            ex.submit(la.emit_reward, 10.0 + task["i"], "from_pool").result()
        la.emit_reward(100.0 + task["i"])

    ctxs = [_ctx(1), _ctx(2)]
    outcomes = await asyncio.gather(*(_run(agent, c) for c in ctxs))
    assert [o.status for o in outcomes] == ["succeeded", "succeeded"]
    for c in ctxs:
        i = c.task["i"]
        got = sorted((r.name, r.value) for r in c.close())
        assert got == [("from_pool", 10.0 + i), ("from_thread", float(i)), ("reward", 100.0 + i)]


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


async def test_single_running_attempt_is_the_fallback_and_ambiguity_raises() -> None:
    a, b = _ctx(5), _ctx(6)
    empty = contextvars.Context()  # a context that never saw any attempt
    with running_attempt(a):
        empty.run(la.emit_reward, 0.75)
        with running_attempt(b), pytest.raises(LightningSDKError, match="2 attempts are running"):
            empty.run(la.emit_reward, 1.0)
    assert [(r.name, r.value) for r in a.close()] == [("reward", 0.75)]
    assert b.close() == []


def test_reward_after_the_attempt_ended_and_bad_values_raise() -> None:
    c = _ctx(7)
    c.close()
    with running_attempt(c), pytest.raises(AttemptNotRunningError):
        la.emit_reward(1.0)
    with pytest.raises(LightningSDKError, match="finite"):
        la.emit_reward(float("nan"))
    with pytest.raises(LightningSDKError, match="number"):
        la.emit_reward("high")  # type: ignore[arg-type]
