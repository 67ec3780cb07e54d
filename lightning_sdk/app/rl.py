"""The phases of a job around the training loop (``app/loop.py``): held-out evaluation and RL with its checks.

``evaluate`` runs the user's agent on held-out tasks through the proxy as an evaluation split (sampled by that
split's rule: the proxy's per-split sampling, ``app.job.split_sampling``, never a setting on the engine).
``run_rl`` runs the in-process agent workers (``RLWorkers``) around ``TrainingLoop.train_steps`` and, with a target
gain (``[rl] target_gain``, ``trainer/stopping.py``), pauses for held-out checks; ``lightning-sdk train`` starts the
workers with the held-out evaluation before RL and keeps them generating through the target checks (``[rl]
generate_during_eval``), so the steps after those evaluations do not wait for their whole batch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_sdk.agent import Agent, WorkerPool, run_tasks
from lightning_sdk.app.loop import StepReport, TrainingLoop, never
from lightning_sdk.errors import RunStopped
from lightning_sdk.trainer.stopping import GainTarget, WallBudget

__all__ = ["RLResult", "RLWorkers", "evaluate", "run_rl"]


async def evaluate(
    loop: TrainingLoop,
    agent: Agent,
    tasks: list[dict[str, Any]],
    split: str,
    workers: int,
    stop: Callable[[], bool] = never,
) -> dict[str, Any]:
    """Run the agent on ``tasks`` through the proxy as ``split`` (the proxy samples it by that split's rule); the
    ``eval_*`` entry of the summary. When ``stop()`` turns true the in-flight attempts are released and
    ``RunStopped`` is raised."""
    pool = WorkerPool(agent, loop.store, loop.url, n_workers=workers, split=split, poll_s=0.05)

    async def watch() -> None:
        while not stop():
            await asyncio.sleep(0.05)
        pool.stop(release=True)

    watcher = asyncio.create_task(watch())
    try:
        t0 = time.perf_counter()
        summary = await run_tasks(agent, loop.store, loop.url, tasks, split=split, pool=pool, poll_s=0.05)
    finally:
        watcher.cancel()
        await pool.close()
    if stop():
        raise RunStopped(loop.step)
    out = summary.to_dict()
    out.pop("failed", None)
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    return out


@dataclass
class RLResult:
    """What ``run_rl`` did: the held-out checks (``step``, ``success_rate``, ``reached``, ``final``, ``why``: what
    made it due, ``trigger``, ``projection``, ``max_steps``, or for the last check ``steps`` or ``wall budget``;
    ``elapsed_s``, ``wall_s``), the check that reached the target (None otherwise), ``final``: the last check when
    nothing was trained after it (the run's ``eval_after``: the check's own result; None without a target),
    ``stop``: why RL ended (``reason``: ``target``, ``max_wall_s``, ``steps``; ``message``; ``short``: a target was
    set and not met), and the wall time."""

    checks: list[dict[str, Any]]
    reached: dict[str, Any] | None
    wall_s: float
    final: dict[str, Any] | None = None
    stop: dict[str, Any] = field(default_factory=dict)


async def run_rl(
    loop: TrainingLoop,
    agent: Agent,
    *,
    steps: int,
    workers: int,
    on_step: Callable[[StepReport], None],
    held_out: Callable[[str, str], Awaitable[dict[str, Any]]],
    target: GainTarget | None = None,
    deadline: float | None = None,
    budget: WallBudget | None = None,
    t_start: float | None = None,
    note: Callable[[str], None] = lambda text: None,
    on_rl: Callable[[], None] = lambda: None,
    stop: Callable[[], bool] = never,
    running: RLWorkers | None = None,
    generate_during_checks: bool = False,
) -> RLResult:
    """RL with in-process workers until ``steps``, the wall budget or ``stop()`` (``RunStopped``). With a ``target``,
    RL pauses whenever the target is due: ``held_out(split, label)`` evaluates the newest weights, and RL ends when
    the gain is confirmed, else goes on (``on_rl`` is told). ``budget`` (``trainer/stopping.py`` ``WallBudget``; or a
    bare ``deadline``, perf_counter, with nothing reserved) ends RL early enough for one more held-out evaluation:
    with a target, RL's end (out of time or of ``steps``) always runs a last check, whose result is the run's final
    evaluation, so a run never misses its target for want of a check. ``running``: workers already started
    (``RLWorkers.start``) that serve the first stretch of RL; run_rl closes them. With ``generate_during_checks``
    the workers go on generating train groups during the checks before RL's end (on the weights being checked; the
    learner is paused, so nothing is published meanwhile): the steps after a check find their groups ready instead of
    waiting for what the pause did not generate and for the attempts it released. The last check runs alone."""
    t_rl = time.perf_counter()
    t_start = t_rl if t_start is None else t_start
    if budget is None and deadline is not None:
        budget = WallBudget(deadline, check_s=0.0, pad_s=0.0)
    checks: list[dict[str, Any]] = []
    pause = target.due if target is not None else never

    def out_of_time() -> bool:
        return budget is not None and budget.rl_over()

    def ended() -> bool:
        return loop.step >= steps or out_of_time()

    def stop_or_pause() -> bool:
        return stop() or pause() or out_of_time()

    def observed(report: StepReport) -> None:
        if budget is not None:
            budget.observe_step(report.wall_s - report.wait_s)
        on_step(report)

    def stopped(reached: dict[str, Any] | None, last: dict[str, Any] | None) -> RLResult:
        reason = "target" if reached is not None else ("steps" if loop.step >= steps else "max_wall_s")
        why = {
            "target": "a held-out check reached the target gain",
            "steps": f"rl.steps = {steps} done",
            "max_wall_s": "the wall budget (rl.max_wall_s) left no time for another step and the final evaluation",
        }[reason]
        info: dict[str, Any] = {"reason": reason, "step": loop.step, "short": False}
        if budget is not None:
            info["left_s"] = round(budget.left_s(), 2)
            info["check_reserve_s"] = round(budget.check_reserve_s, 2)
        message = f"RL ended at step {loop.step}: {why}"
        if target is not None and last is not None:
            gain = last["success_rate"] - target.baseline
            info.update(gain=round(gain, 4), target_gain=target.gain)
            if reached is None:
                info["short"] = True
                message = (
                    f"RL stopped short of its target at step {loop.step}: {why}; held-out gain at the final check "
                    f"{100 * gain:+.1f} points, target {100 * target.gain:+.1f}"
                )
        info["message"] = message
        note(message)
        return RLResult(checks, reached, time.perf_counter() - t_rl, final=last, stop=info)

    try:
        while True:
            if running is None:
                running = await RLWorkers.start(loop, agent, workers)
            await loop.train_steps(steps, on_step=observed, stop=stop_or_pause)
            if stop():
                raise RunStopped(loop.step)
            last_one = ended()
            if target is None:
                break
            if not target.due() and not last_one:
                break
            if last_one or not generate_during_checks:  # the check runs alone; a next stretch starts new workers
                await running.close()
                running = None
            # what made this check come (reached() below resets the target's own answer)
            why = (target.why if target.due() else None) or ("steps" if loop.step >= steps else "wall budget")
            await loop.flush_weights()  # the check evaluates the newest weights
            t_check = time.perf_counter()
            label = f"{'final ' if last_one else ''}target check at step {loop.step}"
            result = await held_out(f"eval-check-{target.checks + 1}", label)
            reached = target.reached(result["success_rate"])
            if budget is not None:
                budget.observe_check(time.perf_counter() - t_check)
            last_one = last_one or reached or ended()  # a missed check that used up the budget is the last one
            checks.append(
                {
                    "step": loop.step,
                    "success_rate": result["success_rate"],
                    "reached": reached,
                    "final": last_one,
                    "why": why,
                    "elapsed_s": round(time.perf_counter() - t_start, 2),
                    "wall_s": round(time.perf_counter() - t_check, 2),
                }
            )
            note(
                f"held-out check at step {loop.step} ({why}): {100 * result['success_rate']:.1f}%"
                f" ({'target reached' if reached else 'the last one' if last_one else 'going on'})"
            )
            if last_one:
                await loop.flush_weights()
                return stopped(result if reached else None, result)
            on_rl()
    finally:
        if running is not None:  # they release their in-flight attempts
            await running.close()
    await loop.flush_weights()
    return stopped(None, None)


class RLWorkers:
    """The in-process agent workers of RL (train split), running from ``start`` until ``close``, which releases
    their in-flight attempts (handed back to the queue). ``run_rl`` starts them (for each stretch of RL between
    held-out checks, or once with ``generate_during_checks``), or takes ones already running: ``lightning-sdk
    train`` starts them with the held-out evaluation before RL, so the first groups are generated while the baseline
    is measured (on the same weights: nothing is trained before that evaluation ends) and the learner's first steps
    find them ready."""

    def __init__(self, loop: TrainingLoop, agent: Agent, workers: int) -> None:
        self.pool = WorkerPool(agent, loop.store, loop.url, n_workers=workers, split="train", poll_s=0.05)
        self._stopping = False
        self._task: asyncio.Task[Any] | None = None

    @classmethod
    async def start(cls, loop: TrainingLoop, agent: Agent, workers: int) -> RLWorkers:
        """Enqueue the first groups (``loop.feed``) and start the workers on them."""
        self = cls(loop, agent, workers)
        await loop.feed()
        self._task = asyncio.create_task(self.pool.run_until(lambda: self._stopping))
        return self

    async def close(self) -> None:
        """Stop claiming, release the in-flight attempts and close the pool (again: a no-op)."""
        if self._task is None:
            return
        task, self._task = self._task, None
        self._stopping = True
        self.pool.stop(release=True)
        try:
            await task
        finally:
            await self.pool.close()
