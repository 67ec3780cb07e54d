"""The training loop, top to bottom: take finished groups, build records, ``learner.step``, checkpoint, publish the
weights. The jobs in ``app/train.py`` / ``app/daemon.py`` set everything up
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

The phases around this loop are ``app/rl.py``'s: ``run_rl`` runs the in-process agent workers (``RLWorkers``)
around ``train_steps`` and, with a target gain, pauses for held-out checks (``evaluate``).

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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_sdk.app.schedule import Schedule, Taken, generated_tokens, group_ids, group_version
from lightning_sdk.errors import RunStopped
from lightning_sdk.memory import release_free_heap
from lightning_sdk.monitoring import OpsMetrics
from lightning_sdk.records import AdvantageConfig, BuildResult, MergeOptions, RecordsConfig, build_records
from lightning_sdk.records.record import Record
from lightning_sdk.store import Store
from lightning_sdk.telemetry import StepSpan, Telemetry
from lightning_sdk.trainer.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from lightning_sdk.trainer.config import RLConfig
from lightning_sdk.trainer.sampling import TaskSampler
from lightning_sdk.types import FinishedGroup, PolicyVersion

if TYPE_CHECKING:
    from lightning_sdk.app.parts import LearnerLike, Parts, ServingEngine

__all__ = [
    "RunStopped",
    "StepReport",
    "TrainingLoop",
    "group_version",
    "never",
    "records_config",
]

logger = logging.getLogger(__name__)


def never() -> bool:
    """The default ``stop``: never."""
    return False


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
            turn_baseline=rl.turn_baseline,
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
    engine_cpu_s: float = 0.0  # of engine_busy_s, the embedded engine thread's own CPU (the rest: waiting for a
    # core or the interpreter lock; 0: not counted)
    engine_decode_steps: int = 0  # the embedded engine's decode forward passes during the step (0: not counted)
    engine_prefills: int = 0  # its prefill forward passes (rows joining the running batch) during the step
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
    ``cpu`` (the event-loop thread's) and the engine's counters (``tokens``, ``engine_busy``, ``engine_cpu``,
    ``engine_passes``) count from the clock's start."""

    #: the engine's counters a step reads from ``engine.stats`` (0 where an engine does not keep one)
    COUNTERS = ("tokens", "busy_s", "cpu_s", "steps", "batches")

    def __init__(self, engine: ServingEngine) -> None:
        self.engine = engine
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()
        self._cpu = time.thread_time()
        self._counts = {key: float(engine.stats.get(key, 0)) for key in self.COUNTERS}

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

    def _since(self, key: str) -> float:
        return float(self.engine.stats.get(key, 0)) - self._counts[key]

    def tokens(self) -> int:
        return int(self._since("tokens"))

    def engine_busy(self) -> float:
        """Seconds the engine spent generating."""
        return self._since("busy_s")

    def engine_cpu(self) -> float:
        """Of those, the embedded engine thread's own CPU seconds."""
        return self._since("cpu_s")

    def engine_passes(self) -> tuple[int, int]:
        """The engine's decode and prefill forward passes: the generated tokens over the decode passes are the mean
        batch a decode pass ran."""
        return int(self._since("steps")), int(self._since("batches"))


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
        ends = self.store.attempt_ends
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
            metrics = await asyncio.to_thread(self._learn, built.records) if built.records else {}
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

    def _learn(self, records: Sequence[Record]) -> dict[str, float]:
        """The learner's step (in a worker thread), then a small policy's freed heap back to the kernel
        (``memory.release_free_heap``: the step's pages come back once per step, not once per tensor)."""
        metrics = self.learner.step(records)
        release_free_heap()
        return metrics

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
        # the learner's state off the event loop: a learner in another process sends it over a pipe (~40 MB for the
        # tiny policy with its optimizer), which would stall the proxy and the agents for that long
        state = await asyncio.to_thread(self.learner.state_dict)
        ckpt = Checkpoint(step, new_version, state, self.consumed, self.schedule.next_task)
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
        decode_steps, prefills = clock.engine_passes()
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
            engine_cpu_s=clock.engine_cpu(),
            engine_decode_steps=decode_steps,
            engine_prefills=prefills,
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
