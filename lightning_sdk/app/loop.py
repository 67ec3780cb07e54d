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

Which groups run next is the schedule's (``app/schedule.py``: the feed that keeps about ``(1 + max_staleness) *
tasks_per_step`` groups outstanding, the task sampler's replays, screening with ``screen_samples`` and the rests it
asks for); the loop waits for what it finds and trains it. Each phase of a step is timed by ``StepClock.phase``
into the step's report (``wait_s``, ``records_s``, ``learner_s``, ``save_s``, ``publish_s``).

``run_rl`` runs the in-process agent workers (``RLWorkers``) around ``train_steps`` and, with a target gain
(``[rl] target_gain``, ``trainer/stopping.py``), pauses for held-out checks (``evaluate``); ``lightning-sdk train``
starts the workers with the held-out evaluation before RL and keeps them generating through the target checks
(``[rl] generate_during_eval``), so the steps after those evaluations do not wait for their whole batch.
Evaluations sample by their split's rule (the proxy's per-split sampling, ``app.job.split_sampling``), never by a
setting on the engine.

The engine and learner are whatever ``app/parts.py`` made of the config (the embedded ones, or verl's FSDP ranks
behind ``VerlLearner`` and SGLang/vLLM servers); ``weights()`` is what the engine gets after a step (a state dict,
or a checkpoint directory for a server), so this loop never asks which backend it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_sdk.agent import Agent, WorkerPool, run_tasks
from lightning_sdk.app.schedule import Schedule, Taken, generated_tokens, group_ids, group_version
from lightning_sdk.errors import RunStopped
from lightning_sdk.monitoring import OpsMetrics
from lightning_sdk.records import AdvantageConfig, BuildResult, MergeOptions, RecordsConfig, build_records
from lightning_sdk.store import AttemptEnds, Store
from lightning_sdk.telemetry import StepSpan, Telemetry
from lightning_sdk.trainer.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from lightning_sdk.trainer.config import RLConfig
from lightning_sdk.trainer.sampling import TaskSampler
from lightning_sdk.trainer.stopping import GainTarget, WallBudget
from lightning_sdk.types import FinishedGroup, PolicyVersion

if TYPE_CHECKING:
    from lightning_sdk.app.parts import LearnerLike, Parts, ServingEngine

__all__ = [
    "RLResult",
    "RLWorkers",
    "RunStopped",
    "StepReport",
    "TrainingLoop",
    "evaluate",
    "group_version",
    "never",
    "records_config",
    "run_rl",
]

logger = logging.getLogger(__name__)


def never() -> bool:
    """The default ``stop``: never."""
    return False


def _engine_busy(engine: Any) -> float:
    """Seconds the engine spent generating so far (0 for engines that do not count it)."""
    return float(getattr(engine, "stats", {}).get("busy_s", 0.0))


def records_config(rl: RLConfig, max_model_len: int | None) -> RecordsConfig:
    """How the loop builds records: the ``[rl]`` section's advantage settings (same names as ``AdvantageConfig``'s),
    and rows never longer than the engine's context (``max_model_len`` where the engine tells it): a longer segment
    is cut and flagged ``truncated``, which the fidelity report counts, so no row is trained past the context."""
    return RecordsConfig(
        merge=MergeOptions(max_length=max_model_len if max_model_len is not None and max_model_len > 0 else None),
        advantage=AdvantageConfig(
            estimator=rl.estimator,
            drop_zero_variance=rl.drop_zero_variance,
            train_single_groups=rl.train_single_groups,
        ),
    )


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
    screened_groups: int = 0  # screened out at their first rollouts (never trained; see screen_samples)
    rollouts: int = 0  # rollouts of the step's groups: trained, dropped stale and screened out
    wasted_rollouts: int = 0  # of those, the rollouts of groups that taught nothing (no record trained)
    generated_tokens: int = 0  # policy completion tokens of the step's groups
    wasted_tokens: int = 0  # of those, the tokens of groups that taught nothing
    fresh_success_rate: float | None = None  # sampled success of the fresh groups' rollouts
    metrics: dict[str, float] = field(default_factory=dict)
    fresh_outcomes: list[float] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("metrics", "fresh_outcomes")}
        out.update(self.metrics)
        return out


class StepClock:
    """The clocks of one training step: ``phase(name)`` adds the seconds its block took to ``seconds[name]``
    (``wait_s``, ``records_s``, ``learner_s``, ``save_s``, ``publish_s``: ``StepReport``'s fields); ``wall``,
    ``cpu`` (the event-loop thread's), ``tokens`` and ``engine_busy`` count from the clock's start."""

    def __init__(self, engine: ServingEngine) -> None:
        self.engine = engine
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()
        self._cpu = time.thread_time()
        self._tokens = engine.stats["tokens"]
        self._busy = _engine_busy(engine)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def wall(self) -> float:
        return time.perf_counter() - self._start

    def cpu(self) -> float:
        return time.thread_time() - self._cpu

    def tokens(self) -> int:
        return self.engine.stats["tokens"] - self._tokens

    def engine_busy(self) -> float:
        return _engine_busy(self.engine) - self._busy


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
        screen_samples: int = 0,
    ) -> None:
        self.store = store
        self.engine = engine
        self.learner = learner
        self.url = url
        # what engine.update_weights gets (a state dict, or a checkpoint directory for a server): see app/parts.py
        self.weights: Callable[[], Any] = weights or learner.weights
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # which groups run next and what a read of finished groups holds: app/schedule.py
        self.schedule = Schedule(
            store,
            train_tasks,
            tasks_per_step=tasks_per_step,
            samples_per_task=samples_per_task,
            max_staleness=max_staleness,
            screen_samples=screen_samples,
            sampler=sampler,
            max_attempts=max_attempts,
        )
        self.tasks_per_step = tasks_per_step
        self.records_config = records_config or RecordsConfig(advantage=AdvantageConfig(drop_zero_variance=True))
        self.step = 0
        self.version = engine.policy_version
        self.consumed: dict[int, dict[str, list[str]]] = {}
        self.dropped_total = 0
        self._read_limit = 4 * tasks_per_step + 64  # finished groups per read (grows: see _take_groups)
        self.learner_busy_s = 0.0
        self._next_weights: tuple[Any, int] | None = None
        self._publisher: asyncio.Task[None] | None = None
        self.ops: OpsMetrics | None = None  # the job's Prometheus metrics (learner, staleness, publication)
        self.telemetry: Telemetry | None = None  # the job's span exporter ([telemetry]; None: off)

    @classmethod
    def configured(
        cls,
        store: Store,
        parts: Parts,
        run_dir: str | Path,
        rl: RLConfig,
        *,
        train_tasks: Sequence[dict[str, Any]] = (),
        url: str = "",
        max_attempts: int = 1,
    ) -> TrainingLoop:
        """The loop of a job: its ``[rl]`` section as it is (group sizes, staleness, screening, the task sampler of
        ``replay_share``, the records' advantage settings) over ``parts`` (``app/parts.py``)."""
        built = records_config(rl, parts.engine.max_model_len)
        if parts.policies:  # each policy's records from its own calls
            built = dataclasses.replace(built, policies=parts.policies)
        sampler = (
            TaskSampler(len(train_tasks), replay_share=rl.replay_share, max_replays=rl.max_replays, seed=rl.seed)
            if rl.replay_share > 0 and train_tasks
            else None
        )
        return cls(
            store,
            parts.engine,
            parts.learner,
            run_dir,
            url=url,
            weights=parts.weights,
            train_tasks=train_tasks,
            tasks_per_step=rl.tasks_per_step,
            samples_per_task=rl.samples_per_task,
            max_staleness=rl.max_staleness,
            records_config=built,
            max_attempts=max_attempts,
            sampler=sampler,
            screen_samples=rl.screen_samples,
        )

    async def resume(self) -> None:
        """Resume from the run directory's checkpoint if any (learner state, step, version, the groups consumed, the
        engine's weights); else publish the starting version."""
        ckpt = load_checkpoint(self.run_dir)
        if ckpt is None:
            await self.store.publish_version(PolicyVersion(version=self.version, step=0))
            return
        self.learner.load_state_dict(ckpt.learner)
        self.step, self.version, self.consumed = ckpt.step, ckpt.version, ckpt.consumed
        self.schedule.resume_at(ckpt.next_task)  # new groups continue after the last enqueued one
        if ckpt.step in ckpt.consumed:  # the crash may have hit between the checkpoint and the store update
            await self.store.consume_groups(ckpt.step, ckpt.groups_of(ckpt.step))
        await self.engine.update_weights(await asyncio.to_thread(self.weights), self.version)
        await self.store.publish_version(PolicyVersion(version=self.version, step=self.step))
        logger.info("resumed from step %d (policy version %d)", self.step, self.version)

    # -- the queue -----------------------------------------------------------------------------------------------
    async def feed(self) -> None:
        """Enqueue train tasks until ``(1 + max_staleness) * tasks_per_step`` groups are outstanding."""
        await self.schedule.feed(self.consumed)

    # -- one step ------------------------------------------------------------------------------------------------
    async def _take_groups(self, stop: Callable[[], bool]) -> tuple[Taken, float]:
        """Wait for ``tasks_per_step`` fresh finished groups; returns what the last read found (``Taken``) and the
        seconds waited. Each read also enqueues the rest of the screening groups whose first rollouts disagreed.

        Reading the finished groups loads each with its calls (read every 50 ms, that was 25% of an RL step's
        profile), so it is done only when it can have changed: an in-process store signals every ended attempt
        (``store.attempt_ends``), and the groups are read again after a signal, at most once per ``_spacing``.
        Without a signal the loop wakes every ``IDLE_S`` only to check ``stop()`` and expire leases. A remote
        store (``HTTPStore``: the attempts end in another process) gives no signal: it is read every ``_spacing``.
        """
        t0 = time.perf_counter()
        ends = getattr(self.store, "attempt_ends", None)
        ends = ends if isinstance(ends, AttemptEnds) else None
        taken = Taken()
        seen: int | None = None  # the signal's count when the groups were last read (None: never read)
        last_read = 0.0
        while True:
            await self.feed()
            if ends is None or seen != ends.count:
                seen = ends.count if ends is not None else 0  # before the read: an end during it reads again
                last_read = time.perf_counter()
                finished = await self.store.finished_groups(limit=self._read_limit, split="train")
                taken = self.schedule.split(finished, self.version)
                self.schedule.screened_waiting = len(taken.screened)
                await self.schedule.extend(taken.extend)
                if len(taken.fresh) >= self.tasks_per_step:
                    return taken, time.perf_counter() - t0
                if len(finished) >= self._read_limit and self._read_limit < self.MAX_READ:
                    # a full page and too few groups to train: the screened-out groups waiting for the next step
                    # and the screening groups waiting for their rests can fill the page and hide the rests
                    # (created later, so further on): read more at once
                    self._read_limit = min(self.MAX_READ, 2 * self._read_limit)
                    seen = None
                    continue
            if stop():
                return taken, time.perf_counter() - t0
            await self.store.expire_leases()
            spacing = self._spacing(self.tasks_per_step - len(taken.fresh))
            await asyncio.sleep(max(0.0, last_read + spacing - time.perf_counter()))
            if ends is not None:
                await ends.wait(seen, self.IDLE_S)

    IDLE_S = 0.4  # how often the wait for groups checks stop() and leases when no attempt ends
    MAX_READ = 8192  # the most finished groups one read loads (the page grows up to it while full and too few)

    @staticmethod
    def _spacing(missing: int) -> float:
        """The least time between two reads of the finished groups: longer while many groups are missing."""
        return 0.05 if missing <= 2 else min(0.4, 0.05 * missing)

    async def train_step(self, stop: Callable[[], bool] = lambda: False) -> StepReport | None:
        """Run one training step (see the module docstring); None when ``stop()`` turned true before it could."""
        clock = StepClock(self.engine)
        wall_start = time.time()  # the step span's clock (telemetry)
        with clock.phase("wait_s"):
            taken, _ = await self._take_groups(stop)
        if len(taken.fresh) < self.tasks_per_step:
            return None
        step = self.step + 1
        with clock.phase("records_s"):  # the learner's own batch building counts in learner_s
            built = build_records(taken.fresh, self.records_config)
            seen = self.schedule.observe(taken.fresh, taken.stale, taken.screened, built.reports)
            staleness = [self.version - (group_version(g) or self.version) for g in taken.fresh]
        with clock.phase("learner_s"):
            metrics = await asyncio.to_thread(self.learner.step, built.records) if built.records else {}
        new_version = self.version + 1 if built.records else self.version
        with clock.phase("save_s"):
            await self._checkpoint(step, new_version, taken)
        wall_publish, published = time.time(), new_version != self.version
        with clock.phase("publish_s"):
            await self._publish_version(new_version)
        if self.telemetry is not None:
            self._step_spans(step, built, taken.fresh, metrics, staleness, wall_start, wall_publish, published)
        self.learner_busy_s += clock.seconds["learner_s"]
        self.dropped_total += len(taken.stale)
        if self.ops is not None:
            trained = bool(built.records)
            learner_s, publish_s = clock.seconds["learner_s"], clock.seconds["publish_s"]
            self.ops.training_step(learner_s if trained else None, publish_s if trained else None, staleness)
        return await self._report(taken, built, staleness, seen, metrics, clock)

    async def _checkpoint(self, step: int, new_version: int, taken: Taken) -> None:
        """Write the checkpoint (weights, optimizer, step, the step's groups), then consume the groups in the store:
        a run killed between the two resumes with the step's groups consumed again (``resume``)."""
        entry = {
            "trained": [gid for g in taken.fresh for gid in group_ids(g)],
            "dropped": [gid for g in taken.stale for gid in group_ids(g)],
        }
        if taken.screened:
            entry["screened"] = [g.group.group_id for g in taken.screened]
        self.consumed[step] = entry
        ckpt = Checkpoint(step, new_version, self.learner.state_dict(), self.consumed, self.schedule.next_task)
        await asyncio.to_thread(save_checkpoint, self.run_dir, ckpt)
        await self.store.consume_groups(step, [gid for ids in entry.values() for gid in ids])
        self.step = step
        self.schedule.consumed(entry["trained"] + entry["dropped"])

    async def _publish_version(self, new_version: int) -> None:
        """A new version (the learner stepped): hand its weights to the engine (swapped in on its own time) and
        publish it in the store."""
        if new_version == self.version:
            return
        self.version = new_version
        self._publish(await asyncio.to_thread(self.weights), new_version)
        await self.store.publish_version(PolicyVersion(version=new_version, step=self.step))

    async def _report(
        self,
        taken: Taken,
        built: BuildResult,
        staleness: list[int],
        seen: tuple[int, list[float]],
        metrics: dict[str, float],
        clock: StepClock,
    ) -> StepReport:
        """The step's row of metrics.jsonl."""
        fresh, stale, screened = taken.fresh, taken.stale, taken.screened
        new_groups, new_outcomes = seen
        taught = {r.group_id for r in built.records}
        useless = [g for g in fresh if g.group.group_id not in taught] + stale + screened
        every = fresh + stale + screened
        # one value per rollout (with several policies each rollout has a report per policy, with the same reward)
        once = {r.rollout_id: r for r in built.reports}.values()
        rewards = [r.reward for r in once if r.reward is not None]
        finals = [r.final_reward for r in once if r.final_reward is not None]  # per-call rewards left out
        n_rollouts = sum(len(g.rollouts) for g in fresh)
        counts = await self.store.counts()
        wall = clock.wall()
        return StepReport(
            step=self.step,
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
            tokens_per_s=clock.tokens() / max(wall, 1e-9),
            **clock.seconds,
            engine_busy_s=clock.engine_busy(),
            loop_cpu_s=clock.cpu(),
            fresh_groups=new_groups,
            screened_groups=len(screened),
            rollouts=sum(len(g.rollouts) for g in every),
            wasted_rollouts=sum(len(g.rollouts) for g in useless),
            generated_tokens=sum(map(generated_tokens, every)),
            wasted_tokens=sum(map(generated_tokens, useless)),
            fresh_success_rate=(sum(new_outcomes) / len(new_outcomes)) if new_outcomes else None,
            metrics=metrics,
            fresh_outcomes=new_outcomes,
        )

    def _step_spans(
        self,
        step: int,
        built: BuildResult,
        fresh: list[FinishedGroup],
        metrics: dict[str, float],
        staleness: list[int],
        wall_start: float,
        wall_publish: float,
        published: bool,
    ) -> None:
        """The step's span (linked to the attempts it trained) and its weight publication's (telemetry on)."""
        assert self.telemetry is not None
        trained = [r.attempt_id for r in built.reports if r.trained and r.attempt_id is not None]
        advantages = [a for rec in built.records if isinstance(a := rec.scalar_advantage(), float)]
        loss = metrics.get("loss")
        parent = self.telemetry.training_step(
            StepSpan(
                step=step,
                version=self.version,
                attempt_ids=trained,
                started_at=wall_start,
                ended_at=wall_publish,
                loss=float(loss) if loss is not None else None,
                advantages=advantages,
                records=len(built.records),
                groups=len(fresh),
                staleness_mean=sum(staleness) / max(1, len(staleness)),
            )
        )
        if published:
            self.telemetry.publication(
                parent, step=step, version=self.version, started_at=wall_publish, ended_at=time.time()
            )

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
    """What ``run_rl`` did: the held-out checks (``step``, ``success_rate``, ``reached``, ``final``, ``elapsed_s``,
    ``wall_s``), the check that reached the target (None otherwise), ``final``: the last check when nothing was
    trained after it (the run's ``eval_after``: the check's own result; None without a target), ``stop``: why RL
    ended (``reason``: ``target``, ``max_wall_s``, ``steps``; ``message``; ``short``: a target was set and not met),
    and the wall time."""

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
                    "elapsed_s": round(time.perf_counter() - t_start, 2),
                    "wall_s": round(time.perf_counter() - t_check, 2),
                }
            )
            note(
                f"held-out check at step {loop.step}: {100 * result['success_rate']:.1f}%"
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
