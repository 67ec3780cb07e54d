"""WorkerPool and run_tasks end to end: real proxy app + mock upstream on loopback, a real SQLite store file, real
openai clients inside the agents. Covers async/sync/command agents, retries after a crash, timeouts, heartbeats
keeping a short lease alive, and graceful stop (drain and release)."""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import lightning_sdk.agent as la
from lightning_sdk.store import ManualClock, Store
from lightning_sdk.types import AttemptStatus, RolloutStatus
from tests.agent.stack import assert_calls_traced, proxy_stack
from tests.support.waiting import until_async


@la.rollout
async def async_agent(task: dict[str, str], llm: la.LLM) -> float:
    client = llm.async_openai_client()
    resp = await client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": task["q"]}])
    la.emit_reward(0.5, name="format")
    return 1.0 if "mock" in (resp.choices[0].message.content or "") else 0.0


@la.rollout
def sync_agent(task: dict[str, str], llm: la.LLM) -> None:
    client = llm.openai_client()
    for turn in range(2):
        client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": f"{task['q']} {turn}"}])
    la.emit_reward(0.25)


async def test_run_tasks_async_and_sync_agents_trace_every_call(tmp_path: Path) -> None:
    async with proxy_stack(tmp_path) as st:
        tasks = [{"q": f"question {i}"} for i in range(4)]
        s1 = await la.run_tasks(async_agent, st.store, st.url, tasks, n_workers=3)
        s2 = await la.run_tasks(sync_agent, st.store, st.url, tasks[:2], n=2, n_workers=4)
        assert (s1.n, s1.succeeded, s1.success_rate, s1.mean_reward) == (4, 4, 1.0, 1.5)  # reward 1.0 + format 0.5
        assert (s2.n, s2.succeeded, s2.success_rate, s2.mean_reward) == (4, 4, 1.0, 0.25)
        assert s1.split != s2.split and s1.split.startswith("run-")
        for r in s1.rollouts + s2.rollouts:
            detail = await st.store.get_rollout(r.rollout_id)
            assert_calls_traced(detail, min_calls=1 if r in s1.rollouts else 2)
            ok = detail.succeeded_attempt()
            assert ok is not None and detail.rollout.split in (s1.split, s2.split)
        first = await st.store.get_rollout(s1.rollouts[0].rollout_id)
        ok = first.succeeded_attempt()
        assert ok is not None
        assert sorted((w.name, w.value) for w in ok.rewards) == [("format", 0.5), ("reward", 1.0)]
        assert ok.calls[0].request["messages"][0]["content"] == first.rollout.task["q"]
        assert s1.to_dict()["n"] == 4 and s1.to_dict()["failed"] == []


async def test_crash_is_retried_up_to_max_attempts_with_the_traceback(tmp_path: Path) -> None:
    tries: dict[str, int] = {}

    @la.rollout(max_attempts=2)
    async def flaky(task: dict[str, str], llm: la.LLM) -> float:
        tries[task["q"]] = tries.get(task["q"], 0) + 1
        await llm.async_openai_client().chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": task["q"]}]
        )
        if task["q"] == "always" or tries[task["q"]] == 1:
            raise RuntimeError(f"agent bug on {task['q']}")
        return 1.0

    async with proxy_stack(tmp_path) as st:
        summary = await la.run_tasks(flaky, st.store, st.url, [{"q": "once"}, {"q": "always"}], n_workers=2)
        assert tries == {"once": 2, "always": 2}
        by_task = {r.task["q"]: r for r in summary.rollouts}
        assert by_task["once"].status == "succeeded" and by_task["once"].reward == 1.0
        assert by_task["always"].status == "failed" and "RuntimeError: agent bug on always" in (
            by_task["always"].error or ""
        )
        assert (summary.n, summary.succeeded, summary.success_rate, summary.mean_reward) == (2, 1, 0.5, 0.5)
        once = await st.store.get_rollout(by_task["once"].rollout_id)
        assert [a.attempt.status for a in once.attempts] == [AttemptStatus.FAILED, AttemptStatus.SUCCEEDED]
        assert "Traceback" in (once.attempts[0].attempt.error or "")
        assert len(once.attempts[0].calls) == 1  # the failed attempt's call is kept, under its own attempt
        assert_calls_traced(once)
        statuses = sorted(a.status for a in summary.attempts)
        assert statuses == ["failed", "failed", "failed", "succeeded"]


async def test_timeout_fails_the_attempt_and_its_token_stops_working(tmp_path: Path) -> None:
    late: list[str] = []
    timed_out = threading.Event()

    @la.rollout(timeout=0.5)
    def slow(task: dict[str, str], llm: la.LLM) -> float:
        timed_out.wait(60)  # still running when the timeout fails the attempt: the test lets it go on after
        try:
            llm.openai_client(max_retries=0).chat.completions.create(
                model=llm.model, messages=[{"role": "user", "content": "too late"}]
            )
            late.append("accepted")
        except Exception as exc:
            late.append(type(exc).__name__)
        return 1.0

    async with proxy_stack(tmp_path) as st:
        summary = await la.run_tasks(slow, st.store, st.url, [{"q": "x"}], n_workers=1)
        assert summary.rollouts[0].status == "failed"
        assert "timed out after 0.5 s" in (summary.rollouts[0].error or "")
        timed_out.set()
        await until_async(lambda: bool(late), what="the late call's answer")
        assert late == ["ConflictError"]  # HTTP 409: the attempt is no longer running
        detail = await st.store.get_rollout(summary.rollouts[0].rollout_id)
        assert detail.attempts[0].calls == []


async def test_heartbeats_keep_a_short_lease_alive(tmp_path: Path) -> None:
    """The store's clock moves 1.2 s (three 0.4 s leases) while the attempt runs, in steps shorter than the lease,
    each after a heartbeat extended it: the lease never expires and the attempt succeeds. Only the test moves the
    clock, so the machine's speed does not matter."""
    clock = ManualClock()
    finish = asyncio.Event()

    @la.rollout
    async def long(task: dict[str, str], llm: la.LLM) -> float:
        await finish.wait()
        return 1.0

    async with proxy_stack(tmp_path, clock=clock) as st:
        run = asyncio.create_task(la.run_tasks(long, st.store, st.url, [{"q": "1"}], lease_s=0.4, heartbeat_s=0.01))
        attempt_id = await asyncio.wait_for(_running_attempt(st.store), 60)
        started = clock()
        for _ in range(4):
            clock.advance(0.3)  # within the lease the last heartbeat gave
            assert await st.store.expire_leases() == []
            await asyncio.wait_for(_extended(st.store, attempt_id, clock() + 0.4), 60)  # a heartbeat since
        assert clock() - started > 2.5 * 0.4  # 1.2 s of store time: three leases, none expired
        finish.set()
        summary = await asyncio.wait_for(run, 60)
        assert summary.succeeded == 1


async def _running_attempt(store: Store) -> str:
    """The id of the first attempt that runs (waits for a worker to claim it)."""
    running: list[str] = []

    async def claimed() -> bool:
        page, _ = await store.list_rollouts(status=RolloutStatus.RUNNING)
        if page:
            running.append((await store.get_rollout(page[0].rollout_id)).attempts[0].attempt.attempt_id)
        return bool(page)

    await until_async(claimed, what="a worker to claim an attempt")
    return running[0]


async def _extended(store: Store, attempt_id: str, until: float) -> None:
    """Wait until a heartbeat extended the attempt's lease to ``until`` (store time)."""

    async def extended() -> bool:
        return ((await store.get_attempt(attempt_id)).lease_expires_at or 0.0) >= until - 1e-6

    await until_async(extended, what=f"a heartbeat to extend the lease to {until}")


async def test_stop_drains_in_flight_then_release_hands_back(tmp_path: Path) -> None:
    """Every attempt in flight has entered the agent before the stop (a task cancelled before its first step never
    reaches the agent: waiting for one of them only, a loaded machine saw 2 released instead of 3)."""
    gate = asyncio.Event()
    started: list[str] = []

    @la.rollout
    async def waits(task: dict[str, str], llm: la.LLM) -> float:
        started.append(task["q"])
        await gate.wait()
        return 1.0

    async with proxy_stack(tmp_path) as st:
        groups = await st.store.enqueue([{"q": str(i)} for i in range(5)], split="s")
        # drain: two in flight finish after stop(), the other three stay queued
        pool = la.WorkerPool(waits, st.store, st.url, n_workers=2, split="s", poll_s=0.05)
        running = asyncio.create_task(pool.run_until())
        await until_async(lambda: len(started) == 2 and pool.stats.in_flight == 2, what="two attempts in the agent")
        pool.stop()
        gate.set()
        results = await running
        assert sorted(r.status for r in results) == ["succeeded", "succeeded"]
        counts = await st.store.counts()
        assert (counts.get("succeeded"), counts.get("queued")) == (2, 3)

        # release: in-flight attempts go back to the queue, not counted against max_attempts
        gate.clear()
        started.clear()
        pool2 = la.WorkerPool(waits, st.store, st.url, n_workers=3, split="s", poll_s=0.05)
        running = asyncio.create_task(pool2.run_until())
        await until_async(lambda: len(started) == 3, what="three attempts in the agent")
        pool2.stop(release=True)
        results = await running
        assert sorted(r.status for r in results) == ["released"] * 3
        counts = await st.store.counts()
        assert (counts.get("succeeded"), counts.get("queued")) == (2, 3)
        page, _ = await st.store.list_rollouts(status=RolloutStatus.QUEUED)
        assert all(r.attempts_used == 0 for r in page)
        await pool.close()
        await pool2.close()
        assert len(groups) == 5


async def test_release_kills_a_running_command_agent(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    script = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(30)"
    agent = la.CommandAgent([sys.executable, "-c", script], kill_grace_s=0.5)
    async with proxy_stack(tmp_path) as st:
        await st.store.enqueue([{"q": "1"}], split="c")
        pool = la.WorkerPool(agent, st.store, st.url, n_workers=1, split="c", poll_s=0.05)
        running = asyncio.create_task(pool.run_until())
        await until_async(lambda: pidfile.exists() and bool(pidfile.read_text()), what="the agent's process")
        pool.stop(release=True)
        results = await running
        await pool.close()
        assert [r.status for r in results] == ["released"]
        pid = int(pidfile.read_text())
        await until_async(lambda: not Path(f"/proc/{pid}").exists(), timeout=10, what="the agent's process to end")
        assert (await st.store.counts()).get("queued") == 1


async def test_release_right_after_a_claim_hands_back_the_attempt_that_never_started(tmp_path: Path) -> None:
    """``stop(release=True)`` landing between a claim and the first step of its task: the task is cancelled before
    its coroutine runs, so nothing inside it can release the attempt. The pool releases it itself: the rollout is
    queued again at once (not held until its lease expires), and the result says ``released``. Before the fix the
    attempt stayed ``running`` with a 300 s lease and run_until returned no result for it."""
    ran: list[str] = []

    @la.rollout
    async def agent(task: dict[str, str], llm: la.LLM) -> float:
        ran.append(task["q"])
        return 1.0

    async with proxy_stack(tmp_path) as st:
        await st.store.enqueue([{"q": "1"}], split="r")
        pool: la.WorkerPool | None = None

        class StopAfterClaim:
            """The real store; its ``claim`` schedules the release to run right after the claim returns (before
            the attempt's task takes its first step)."""

            def __getattr__(self, name: str) -> object:
                return getattr(st.store, name)

            async def claim(self, *args: object, **kwargs: object) -> object:
                got = await st.store.claim(*args, **kwargs)  # type: ignore[arg-type]
                if got is not None:
                    assert pool is not None
                    asyncio.get_running_loop().call_soon(lambda: pool.stop(release=True))
                return got

        pool = la.WorkerPool(agent, StopAfterClaim(), st.url, n_workers=1, split="r", poll_s=0.05, lease_s=300)  # type: ignore[arg-type]
        results = await asyncio.wait_for(pool.run_until(), 30)
        await pool.close()
        assert ran == []  # the agent never ran
        assert [r.status for r in results] == ["released"]
        counts = await st.store.counts()
        assert counts.get("queued") == 1 and not counts.get("running")
        page, _ = await st.store.list_rollouts(status=RolloutStatus.QUEUED)
        assert [r.attempts_used for r in page] == [0]
