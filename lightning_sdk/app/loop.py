"""The training loop, top to bottom: take finished groups, build records, ``learner.step``, checkpoint, publish the
weights; and the held-out checks that pause it. The jobs in ``app/train.py`` / ``app/daemon.py`` set everything up
(``app/job.py``) and run this.

    ┌──────── agents (in process: WorkerPool; or remote: lightning-sdk run) ────────┐
    │            HTTP (OpenAI API, attempt token)                                    │
    ▼                                                                                │
  proxy ──ids──▶ engine (embedded: a worker thread batching requests; or vLLM/SGLang) │
    │ calls                                                                          │
    ▼                                                                                │
  store ──finished groups (≤ max_staleness versions old)──▶ records ──▶ learner (thread)
    ▲                                                                    │
    └──────────── consume_groups(step) ◀── checkpoint ◀── new weights ───┘──▶ engine.update_weights(version+1)

Rollouts keep flowing while the learner trains: the engine serves agents from its own thread and the learner
steps in another, so the event loop (proxy, store, workers) never waits for either. One training step
(``TrainingLoop.train_step``):

1. take ``tasks_per_step`` finished train groups, oldest first, waking when the store signals that attempts ended
   (``_take_groups``); a group sampled more than ``max_staleness`` policy versions ago (its oldest call) is dropped
   (consumed without training, counted);
2. build records (merge, advantages: GRPO by default); ``learner.step(records)`` in a thread (each backend builds
   its own batch from the records);
3. write the checkpoint (weights, optimizer, step, the step's groups), then ``consume_groups(step, ...)``, then
   publish the version and hand the weights to the engine (swapped in as soon as its running batch ends; the
   learner does not wait for that). See ``trainer/checkpoint.py`` for why this order makes a killed run resume
   with no group trained twice and none lost.

The loop also feeds the queue: it enqueues train tasks (client-chosen group ids ``train-<k>``, so a restart never
enqueues one twice) to keep about ``(1 + max_staleness) * tasks_per_step`` groups outstanding.

``run_rl`` runs the in-process agent workers around ``train_steps`` and, with a target gain (``[rl] target_gain``,
``trainer/stopping.py``), pauses for held-out checks (``evaluate``); evaluations sample by their split's rule
(the proxy's per-split sampling, ``app.job.split_sampling``), never by a setting on the engine.

The engine and learner are whatever ``app/parts.py`` made of the config (the embedded ones, or verl's FSDP ranks
behind ``VerlLearner`` and SGLang/vLLM servers); ``weights()`` is what the engine gets after a step (a state dict,
or a checkpoint directory for a server), so this loop never asks which backend it runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_sdk.agent import WorkerPool, run_tasks
from lightning_sdk.agent._base import Agent
from lightning_sdk.agent.tasks import rollout_reward
from lightning_sdk.errors import TrainerError
from lightning_sdk.records import AdvantageConfig, RecordsConfig, build_records
from lightning_sdk.store._events import AttemptEnds
from lightning_sdk.store.base import Store
from lightning_sdk.trainer.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from lightning_sdk.trainer.stopping import GainTarget
from lightning_sdk.types import FinishedGroup, PolicyVersion

if TYPE_CHECKING:
    from lightning_sdk.app.parts import LearnerLike, ServingEngine
    from lightning_sdk.trainer.sampling import TaskSampler

__all__ = ["RLResult", "RunStopped", "StepReport", "TrainingLoop", "evaluate", "group_version", "never", "run_rl"]

logger = logging.getLogger(__name__)


class RunStopped(TrainerError):
    """The run was asked to stop (``stop()`` turned true) before it finished; ``step`` is the last checkpointed one."""

    def __init__(self, step: int) -> None:
        super().__init__(f"stopped at step {step}")
        self.step = step


def never() -> bool:
    """The default ``stop``: never."""
    return False


def group_version(group: FinishedGroup) -> int | None:
    """The oldest policy version that sampled any call of the group (None: no policy calls)."""
    versions = [
        c.policy_version
        for d in group.rollouts
        for a in d.attempts
        for c in a.calls
        if c.is_policy and c.policy_version is not None
    ]
    return min(versions) if versions else None


def _engine_busy(engine: Any) -> float:
    """Seconds the engine spent generating so far (0 for engines that do not count it)."""
    return float(getattr(engine, "stats", {}).get("busy_s", 0.0))


def _rewards_of(group: FinishedGroup) -> list[float]:
    """The final reward of each rollout's succeeded attempt (rollouts without one are left out)."""
    return [r for r in map(rollout_reward, group.rollouts) if r is not None]


@dataclass
class StepReport:
    """What one training step did (a row of metrics.jsonl)."""

    step: int
    version: int
    wall_s: float
    groups: int
    dropped_stale: int
    records: int
    reward_mean: float
    success_rate: float
    staleness_mean: float
    staleness_max: int
    zero_variance_groups: int
    queue_depth: int
    tokens_per_s: float
    learner_s: float
    wait_s: float
    records_s: float = 0.0  # build records and the padded batch
    save_s: float = 0.0  # checkpoint + consume the groups in the store
    publish_s: float = 0.0  # take the weights and hand them to the engine (the swap itself runs on)
    engine_busy_s: float = 0.0  # engine thread time spent generating during the step
    loop_cpu_s: float = 0.0  # CPU of the event-loop thread during the step: proxy, store, in-process agents
    fresh_groups: int = 0  # groups on tasks never trained on before (the rest are replays, see sampling.py)
    fresh_success_rate: float | None = None  # sampled success of the fresh groups' rollouts
    metrics: dict[str, float] = field(default_factory=dict)
    fresh_outcomes: list[float] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("metrics", "fresh_outcomes")}
        out.update(self.metrics)
        return out


class TrainingLoop:
    """The RL loop over a store, a serving engine and a learner; ``url`` is the proxy the agents call (served by the
    job: ``app/server.py``). ``resume`` first, then ``train_steps`` (or ``run_rl`` with in-process workers)."""

    def __init__(
        self,
        store: Store,
        engine: ServingEngine,
        learner: LearnerLike,
        run_dir: str | Path,
        *,
        url: str = "",
        weights: Callable[[], Any] | None = None,
        train_tasks: Sequence[dict[str, Any]] = (),
        tasks_per_step: int = 16,
        samples_per_task: int = 8,
        max_staleness: int = 1,
        records_config: RecordsConfig | None = None,
        max_attempts: int = 1,
        sampler: TaskSampler | None = None,
    ) -> None:
        self.store = store
        self.engine = engine
        self.learner = learner
        self.url = url
        # what engine.update_weights gets (a state dict, or a checkpoint directory for a server): see app/parts.py
        self.weights: Callable[[], Any] = weights or learner.weights
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.train_tasks = list(train_tasks)
        self.tasks_per_step = tasks_per_step
        self.samples_per_task = samples_per_task
        self.max_attempts = max_attempts  # tries per train rollout (a crashed attempt is retried, never trained)
        self.max_staleness = max_staleness
        self.records_config = records_config or RecordsConfig(advantage=AdvantageConfig(drop_zero_variance=True))
        self.step = 0
        self.version = engine.policy_version
        self.next_task = 0
        # which task each new group runs (None: the train tasks in order); see trainer/sampling.py
        self.sampler = sampler
        self.consumed: dict[int, dict[str, list[str]]] = {}
        self.dropped_total = 0
        self.learner_busy_s = 0.0
        self._next_weights: tuple[Any, int] | None = None
        self._publisher: asyncio.Task[None] | None = None

    async def resume(self) -> None:
        """Resume from the run directory's checkpoint if any (learner state, step, version, the groups consumed, the
        engine's weights); else publish the starting version."""
        ckpt = load_checkpoint(self.run_dir)
        if ckpt is None:
            await self.store.publish_version(PolicyVersion(version=self.version, step=0))
            return
        self.learner.load_state_dict(ckpt.learner)
        self.step, self.version, self.next_task, self.consumed = ckpt.step, ckpt.version, ckpt.next_task, ckpt.consumed
        if ckpt.step in ckpt.consumed:  # the crash may have hit between the checkpoint and the store update
            await self.store.consume_groups(ckpt.step, ckpt.groups_of(ckpt.step))
        await self.engine.update_weights(await asyncio.to_thread(self.weights), self.version)
        await self.store.publish_version(PolicyVersion(version=self.version, step=self.step))
        logger.info("resumed from step %d (policy version %d)", self.step, self.version)

    # -- the queue -----------------------------------------------------------------------------------------------
    async def feed(self) -> None:
        """Enqueue train tasks until ``(1 + max_staleness) * tasks_per_step`` groups are outstanding."""
        if not self.train_tasks:
            return
        consumed = sum(len(v.get("trained", [])) + len(v.get("dropped", [])) for v in self.consumed.values())
        want = (1 + self.max_staleness) * self.tasks_per_step - (self.next_task - consumed)
        if want <= 0:
            return
        ks = range(self.next_task, self.next_task + want)
        if self.sampler is not None:
            tasks = [self.train_tasks[self.sampler.pick(f"train-{k}")] for k in ks]
        else:
            tasks = [self.train_tasks[k % len(self.train_tasks)] for k in ks]
        await self.store.enqueue(
            tasks,
            n=self.samples_per_task,
            split="train",
            max_attempts=self.max_attempts,
            group_ids=[f"train-{k}" for k in ks],
        )
        self.next_task += want

    # -- one step ------------------------------------------------------------------------------------------------
    async def _take_groups(self, stop: Callable[[], bool]) -> tuple[list[FinishedGroup], list[FinishedGroup], float]:
        """Wait for ``tasks_per_step`` fresh finished groups; returns (fresh, stale, seconds waited).

        Reading the finished groups loads each with its calls (read every 50 ms, that was 25% of an RL step's
        profile), so it is done only when it can have changed: an in-process store signals every ended attempt
        (``store.attempt_ends``), and the groups are read again after a signal, at most once per ``_spacing``.
        Without a signal the loop wakes every ``IDLE_S`` only to check ``stop()`` and expire leases. A remote
        store (``HTTPStore``: the attempts end in another process) gives no signal: it is read every ``_spacing``.
        """
        t0 = time.perf_counter()
        ends = getattr(self.store, "attempt_ends", None)
        ends = ends if isinstance(ends, AttemptEnds) else None
        fresh: list[FinishedGroup] = []
        stale: list[FinishedGroup] = []
        seen: int | None = None  # the signal's count when the groups were last read (None: never read)
        last_read = 0.0
        while True:
            await self.feed()
            if ends is None or seen != ends.count:
                seen = ends.count if ends is not None else 0  # before the read: an end during it reads again
                last_read = time.perf_counter()
                fresh, stale = self._split_fresh(
                    await self.store.finished_groups(limit=4 * self.tasks_per_step + 64, split="train")
                )
                if len(fresh) >= self.tasks_per_step:
                    return fresh, stale, time.perf_counter() - t0
            if stop():
                return fresh, stale, time.perf_counter() - t0
            await self.store.expire_leases()
            spacing = self._spacing(self.tasks_per_step - len(fresh))
            await asyncio.sleep(max(0.0, last_read + spacing - time.perf_counter()))
            if ends is not None:
                await ends.wait(seen, self.IDLE_S)

    IDLE_S = 0.4  # how often the wait for groups checks stop() and leases when no attempt ends

    @staticmethod
    def _spacing(missing: int) -> float:
        """The least time between two reads of the finished groups: longer while many groups are missing."""
        return 0.05 if missing <= 2 else min(0.4, 0.05 * missing)

    def _split_fresh(self, finished: list[FinishedGroup]) -> tuple[list[FinishedGroup], list[FinishedGroup]]:
        """(the oldest ``tasks_per_step`` groups within ``max_staleness`` versions, every staler group)."""
        fresh: list[FinishedGroup] = []
        stale: list[FinishedGroup] = []
        for g in finished:
            v = group_version(g)
            if v is not None and self.version - v > self.max_staleness:
                stale.append(g)
            elif len(fresh) < self.tasks_per_step:
                fresh.append(g)
        return fresh, stale

    async def train_step(self, stop: Callable[[], bool] = lambda: False) -> StepReport | None:
        """Run one training step (see the module docstring); None when ``stop()`` turned true before it could."""
        t_start = time.perf_counter()
        cpu_start = time.thread_time()
        tokens_before = self.engine.stats["tokens"]
        busy_before = _engine_busy(self.engine)
        fresh, stale, waited = await self._take_groups(stop)
        if len(fresh) < self.tasks_per_step:
            return None
        step = self.step + 1
        t_records = time.perf_counter()
        built = build_records(fresh, self.records_config)
        new_groups, new_outcomes = self._observe(fresh, stale, built.reports)
        rewards = [r.reward for r in built.reports if r.reward is not None]
        finals = [r.final_reward for r in built.reports if r.final_reward is not None]  # per-call rewards left out
        n_rollouts = sum(len(g.rollouts) for g in fresh)
        staleness = [self.version - (group_version(g) or self.version) for g in fresh]
        metrics: dict[str, float] = {}
        learner_s = 0.0
        records_s = time.perf_counter() - t_records  # the learner's own batch building counts in learner_s
        if built.records:
            t0 = time.perf_counter()
            metrics = await asyncio.to_thread(self.learner.step, built.records)  # the learner builds its batch
            learner_s = time.perf_counter() - t0
            self.learner_busy_s += learner_s
            new_version = self.version + 1
        else:
            new_version = self.version
        self.consumed[step] = {
            "trained": [g.group.group_id for g in fresh],
            "dropped": [g.group.group_id for g in stale],
        }
        t_save = time.perf_counter()
        await asyncio.to_thread(
            save_checkpoint,
            self.run_dir,
            Checkpoint(step, new_version, self.learner.state_dict(), self.consumed, self.next_task),
        )
        await self.store.consume_groups(step, self.consumed[step]["trained"] + self.consumed[step]["dropped"])
        self.step = step
        t_publish = time.perf_counter()
        save_s = t_publish - t_save
        if new_version != self.version:
            self.version = new_version
            self._publish(await asyncio.to_thread(self.weights), new_version)
            await self.store.publish_version(PolicyVersion(version=new_version, step=step))
        publish_s = time.perf_counter() - t_publish
        self.dropped_total += len(stale)
        counts = await self.store.counts()
        wall = time.perf_counter() - t_start
        return StepReport(
            step=step,
            version=self.version,
            wall_s=wall,
            groups=len(fresh),
            dropped_stale=len(stale),
            records=len(built.records),
            reward_mean=sum(rewards) / max(1, n_rollouts),
            success_rate=sum(1 for r in finals if r > 0) / max(1, n_rollouts),
            staleness_mean=sum(staleness) / max(1, len(staleness)),
            staleness_max=max(staleness, default=0),
            zero_variance_groups=built.zero_variance_groups,
            queue_depth=int(counts.get("queued", 0)),
            tokens_per_s=(self.engine.stats["tokens"] - tokens_before) / max(wall, 1e-9),
            learner_s=learner_s,
            wait_s=waited,
            records_s=records_s,
            save_s=save_s,
            publish_s=publish_s,
            engine_busy_s=_engine_busy(self.engine) - busy_before,
            loop_cpu_s=time.thread_time() - cpu_start,
            fresh_groups=new_groups,
            fresh_success_rate=(sum(new_outcomes) / len(new_outcomes)) if new_outcomes else None,
            metrics=metrics,
            fresh_outcomes=new_outcomes,
        )

    def _observe(
        self, fresh: list[FinishedGroup], stale: list[FinishedGroup], reports: Sequence[Any]
    ) -> tuple[int, list[float]]:
        """Tell the sampler each consumed group's rewards; returns (groups on never-trained tasks, their rollouts'
        outcomes). Without a sampler every group counts as fresh."""
        by_group: dict[str, list[float]] = {}
        for r in reports:
            if r.final_reward is not None:  # the outcome: per-call rewards would count a half-fixed task as solved
                by_group.setdefault(r.group_id, []).append(float(r.final_reward))
        n_new, outcomes = 0, []
        for g in fresh:
            gid = g.group.group_id
            rewards = by_group.get(gid, [])
            is_new = self.sampler.is_fresh(gid) if self.sampler is not None else True
            if is_new is not False:
                n_new += 1
                outcomes += [1.0 if r > 0 else 0.0 for r in rewards]
            if self.sampler is not None:
                self.sampler.observe(gid, rewards)
        if self.sampler is not None:
            for g in stale:  # still a sign of which tasks sit at the frontier
                self.sampler.observe(g.group.group_id, _rewards_of(g))
        return n_new, outcomes

    def _publish(self, weights: Any, version: int) -> None:
        """Hand new weights to the engine without waiting: the swap waits for the engine's running batch, and the
        learner should not. Only the newest pending weights are swapped in."""
        self._next_weights = (weights, version)
        if self._publisher is None or self._publisher.done():
            self._publisher = asyncio.create_task(self._publish_loop())

    async def _publish_loop(self) -> None:
        while self._next_weights is not None:
            weights, version = self._next_weights
            self._next_weights = None
            await self.engine.update_weights(weights, version)

    async def flush_weights(self) -> None:
        """Wait until the engine serves the latest published weights."""
        if self._publisher is not None:
            await self._publisher

    async def train_steps(
        self,
        steps: int,
        *,
        deadline: float | None = None,
        on_step: Callable[[StepReport], None] | None = None,
        stop: Callable[[], bool] = lambda: False,
    ) -> list[StepReport]:
        """Train until ``steps`` steps are done (counting resumed ones), ``deadline`` (perf_counter) or ``stop()``."""

        def done() -> bool:
            return stop() or (deadline is not None and time.perf_counter() >= deadline)

        reports: list[StepReport] = []
        while self.step < steps and not done():
            report = await self.train_step(done)
            if report is None:
                break
            reports.append(report)
            logger.info(
                "step %d: reward %.3f, success %.1f%%, staleness %.2f, %d dropped, %.0f tok/s",
                report.step,
                report.reward_mean,
                100 * report.success_rate,
                report.staleness_mean,
                report.dropped_stale,
                report.tokens_per_s,
            )
            if on_step is not None:
                on_step(report)
        return reports


# -- evaluation and RL with held-out checks ----------------------------------------------------------------------------
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
    """What ``run_rl`` did: the held-out checks (``step``, ``success_rate``, ``reached``, ``elapsed_s``,
    ``wall_s``), the check that reached the target (the run's ``eval_after``; None otherwise) and the wall time."""

    checks: list[dict[str, Any]]
    reached: dict[str, Any] | None
    wall_s: float


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
    t_start: float | None = None,
    note: Callable[[str], None] = lambda text: None,
    on_rl: Callable[[], None] = lambda: None,
    stop: Callable[[], bool] = never,
) -> RLResult:
    """RL with in-process workers until ``steps``, ``deadline`` or ``stop()`` (``RunStopped``). With a ``target``,
    RL pauses whenever the target is due: the workers release their attempts, ``held_out(split, label)`` evaluates
    the newest weights, and RL ends when the gain is confirmed, else goes on (``on_rl`` is told)."""
    t_rl = time.perf_counter()
    t_start = t_rl if t_start is None else t_start
    checks: list[dict[str, Any]] = []
    pause = target.due if target is not None else never

    def stop_or_pause() -> bool:
        return stop() or pause()

    while True:
        await _with_workers(
            loop, agent, workers, loop.train_steps(steps, deadline=deadline, on_step=on_step, stop=stop_or_pause)
        )
        if stop():
            raise RunStopped(loop.step)
        if target is None or not target.due():
            break
        await loop.flush_weights()  # the check evaluates the newest weights
        t_check = time.perf_counter()
        result = await held_out(f"eval-check-{target.checks + 1}", f"target check at step {loop.step}")
        reached = target.reached(result["success_rate"])
        checks.append(
            {
                "step": loop.step,
                "success_rate": result["success_rate"],
                "reached": reached,
                "elapsed_s": round(time.perf_counter() - t_start, 2),
                "wall_s": round(time.perf_counter() - t_check, 2),
            }
        )
        note(
            f"held-out check at step {loop.step}: {100 * result['success_rate']:.1f}%"
            f" ({'target reached' if reached else 'going on'})"
        )
        if reached:
            await loop.flush_weights()
            return RLResult(checks, result, time.perf_counter() - t_rl)
        if loop.step >= steps or (deadline is not None and time.perf_counter() >= deadline):
            break
        on_rl()
    await loop.flush_weights()
    return RLResult(checks, None, time.perf_counter() - t_rl)


async def _with_workers(loop: TrainingLoop, agent: Agent, workers: int, training: Awaitable[Any]) -> None:
    """Run the in-process agent workers while ``training`` runs; they release their in-flight attempts after."""
    pool = WorkerPool(agent, loop.store, loop.url, n_workers=workers, split="train", poll_s=0.05)
    stopping = False
    pool_task = asyncio.create_task(pool.run_until(lambda: stopping))
    try:
        await training
    finally:
        stopping = True
        pool.stop(release=True)
        await pool_task
        await pool.close()
