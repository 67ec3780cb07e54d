"""Run an agent over exactly a given list of tasks and summarise: collecting traces, or evaluating an agent.

``run_tasks`` enqueues the tasks in a split of their own (``run-<id>`` unless told; a split other than ``train``
is never consumed by training), runs a ``WorkerPool`` that claims only that split, and waits until every rollout
is terminal — also those another worker of the same server picked up. The summary is read back from the store,
so it counts what was committed, not what the worker believes:

* ``n`` — rollouts; ``succeeded`` — rollouts whose attempt succeeded (the agent ran to the end);
* ``mean_reward`` — mean over all ``n`` of the rollout's reward (the sum of the succeeded attempt's final rewards;
  0 for a rollout that failed or gave none);
* ``success_rate`` — the fraction of the ``n`` rollouts that succeeded with a reward > 0 (for 0/1 rewards: accuracy).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from lightning_sdk.agent._base import Agent
from lightning_sdk.agent.worker import AttemptResult, WorkerPool
from lightning_sdk.errors import ConfigError
from lightning_sdk.store.base import Store
from lightning_sdk.types import FinishedGroup, RolloutDetail, RolloutStatus, Task

__all__ = ["RolloutSummary", "RunSummary", "rollout_reward", "run_tasks", "summarise"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutSummary:
    rollout_id: str
    task: Task
    status: str
    reward: float | None
    error: str | None  # the last attempt's error, for a rollout that did not succeed


@dataclass
class RunSummary:
    """What a run over a task list produced (see the module docstring for the definitions)."""

    n: int
    succeeded: int
    success_rate: float
    mean_reward: float
    split: str
    rollouts: list[RolloutSummary] = field(default_factory=list)
    attempts: list[AttemptResult] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """``{"success_rate", "mean_reward", "n", ...}`` (the shape of ``eval_before`` in ``summary.json``)."""
        return {
            "success_rate": self.success_rate,
            "mean_reward": self.mean_reward,
            "n": self.n,
            "succeeded": self.succeeded,
            "split": self.split,
            "failed": [
                {"rollout_id": r.rollout_id, "status": r.status, "error": r.error}
                for r in self.rollouts
                if r.status != RolloutStatus.SUCCEEDED.value
            ],
        }


def rollout_reward(detail: RolloutDetail) -> float | None:
    """The sum of the succeeded attempt's final rewards (``call_id`` None); None without any."""
    ok = detail.succeeded_attempt()
    if ok is None:
        return None
    finals = [r.value for r in ok.rewards if r.call_id is None]
    return float(sum(finals)) if finals else None


def summarise(groups: list[FinishedGroup], split: str, attempts: list[AttemptResult] | None = None) -> RunSummary:
    """A ``RunSummary`` of finished groups."""
    rollouts: list[RolloutSummary] = []
    for g in groups:
        for d in g.rollouts:
            last_error = next((a.attempt.error for a in reversed(d.attempts) if a.attempt.error), None)
            ok = d.rollout.status is RolloutStatus.SUCCEEDED
            rollouts.append(
                RolloutSummary(
                    d.rollout.rollout_id,
                    d.rollout.task,
                    d.rollout.status.value,
                    rollout_reward(d),
                    None if ok else last_error,
                )
            )
    n = len(rollouts)
    rewards = [r.reward or 0.0 for r in rollouts]
    succeeded = sum(r.status == RolloutStatus.SUCCEEDED.value for r in rollouts)
    solved = sum(r.status == RolloutStatus.SUCCEEDED.value and (r.reward or 0.0) > 0 for r in rollouts)
    return RunSummary(
        n=n,
        succeeded=succeeded,
        success_rate=solved / n if n else 0.0,
        mean_reward=sum(rewards) / n if n else 0.0,
        split=split,
        rollouts=rollouts,
        attempts=list(attempts or []),
    )


async def run_tasks(
    agent: Agent,
    store: Store,
    server_url: str,
    tasks: list[Task],
    *,
    n: int = 1,
    n_workers: int = 4,
    model: str = "policy",
    split: str | None = None,
    max_attempts: int | None = None,
    pool: WorkerPool | None = None,
    poll_s: float = 0.5,
    **pool_kwargs: Any,
) -> RunSummary:
    """Enqueue ``tasks`` (``n`` rollouts each), run ``agent`` on exactly them, wait until all are terminal and
    summarise. ``pool`` lets a caller keep control (``pool.stop()`` from a signal handler); it must have been made with
    a ``split`` of its own, which the run then uses. A pool passed in is not closed here."""
    if pool is not None:
        if pool.split is None or (split is not None and split != pool.split):
            raise ConfigError(f"run_tasks: the pool must claim the run's split (pool {pool.split!r}, run {split!r})")
        split = pool.split
    split = split or f"run-{uuid.uuid4().hex[:8]}"
    tries = max_attempts if max_attempts is not None else agent.max_attempts
    groups = await store.enqueue(list(tasks), n=n, max_attempts=tries, split=split)
    want = {g.group_id for g in groups}
    logger.info("enqueued %d tasks x %d rollouts in split %r", len(groups), n, split)
    own_pool = pool is None
    if pool is None:
        pool = WorkerPool(agent, store, server_url, n_workers=n_workers, model=model, split=split, **pool_kwargs)
    try:
        while True:
            await pool.run_until(drain=True)
            finished = [
                g for g in await store.finished_groups(limit=len(want) + 1, split=split) if g.group.group_id in want
            ]
            if len(finished) >= len(want) or pool.stopping:
                break
            await asyncio.sleep(
                poll_s
            )  # rollouts still running on another worker, or queued again after a lease expiry
    finally:
        if own_pool:
            await pool.close()
    if pool.stopping and len(finished) < len(want):
        logger.warning("stopped with %d of %d tasks finished", len(finished), len(want))
    return summarise(finished, split, pool.results)
