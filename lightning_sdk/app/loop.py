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
enqueues one twice) to keep about ``(1 + max_staleness) * tasks_per_step`` groups outstanding (not yet trained,
dropped or screened out).

Groups sized to the task (``screen_samples`` = k > 0): a group on a task never run before starts with k rollouts.
When its k rewards all agree it is *screened out*: consumed with the next step, never trained, its generation
stopped at k of ``samples_per_task``. When they differ, the loop enqueues the rest of the group (``samples_per_task
- k`` rollouts, group id ``train-<k>-rest``, idempotent) and trains both as one group of ``samples_per_task``
rollouts once both finished: the advantages see all of them, the screening rollouts first. Every decision is a
function of what the store holds (group sizes, finished rollouts, rewards), so a restart takes it again and asks
for a rest group that already exists, which is a no-op. Replays (``trainer/sampling.py``: their task's last group
had variance) run full groups at once. Screened-out groups do not count towards ``tasks_per_step``: each step
still trains that many full groups. The fresh-task success the target check watches counts only the k screening
rollouts of each fresh task (screened out or not), so every task weighs the same whatever its group grew to.
Staleness: the rest is asked for only once the first rollouts finished and waits behind the groups already queued,
so a grown group's first rollouts may be one version older than ``max_staleness`` (its rest is held to the bound).

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
from lightning_sdk.monitoring import OpsMetrics
from lightning_sdk.records import AdvantageConfig, MergeOptions, RecordsConfig, build_records
from lightning_sdk.store._events import AttemptEnds
from lightning_sdk.store.base import Store
from lightning_sdk.trainer.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from lightning_sdk.trainer.config import RLConfig
from lightning_sdk.trainer.sampling import TaskSampler
from lightning_sdk.trainer.stopping import GainTarget
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


def records_config(rl: RLConfig, engine: object) -> RecordsConfig:
    """How the loop builds records: the ``[rl]`` section's advantage settings (same names as ``AdvantageConfig``'s),
    and rows never longer than the engine's context (``max_model_len`` where the engine tells it): a longer segment
    is cut and flagged ``truncated``, which the fidelity report counts, so no row is trained past the context."""
    limit = getattr(engine, "max_model_len", None)
    return RecordsConfig(
        merge=MergeOptions(max_length=limit if isinstance(limit, int) and limit > 0 else None),
        advantage=AdvantageConfig(
            estimator=rl.estimator,
            drop_zero_variance=rl.drop_zero_variance,
            train_single_groups=rl.train_single_groups,
        ),
    )


REST = "-rest"
"""The group id suffix of the rest of a screened group: ``train-<k>-rest`` completes ``train-<k>``."""


def group_ids(group: FinishedGroup) -> list[str]:
    """The store's group ids behind ``group``: its own, then its rest group's when it was merged with one."""
    return list(dict.fromkeys([group.group.group_id, *(d.rollout.group_id for d in group.rollouts)]))


def merge_rest(base: FinishedGroup, rest: FinishedGroup) -> FinishedGroup:
    """A screened group and its rest as one group (the screening rollouts first), trained as one: its id and task
    are the screening group's, its ``n`` the sum."""
    group = base.group.model_copy(update={"n": base.group.n + rest.group.n})
    return FinishedGroup(group, [*base.rollouts, *rest.rollouts])


def generated_tokens(group: FinishedGroup) -> int:
    """Completion tokens the policy generated for the group (every attempt, trained or not)."""
    return sum(len(c.completion_ids) for d in group.rollouts for a in d.attempts for c in a.calls if c.is_policy)


@dataclass
class Taken:
    """What one wait for groups found: ``fresh`` (to train, oldest first), ``stale`` (to drop), ``screened``
    (screened out: their first rollouts all agreed) and ``extend`` (screening groups whose rest is due)."""

    fresh: list[FinishedGroup] = field(default_factory=list)
    stale: list[FinishedGroup] = field(default_factory=list)
    screened: list[FinishedGroup] = field(default_factory=list)
    extend: list[FinishedGroup] = field(default_factory=list)


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
        if screen_samples and not 2 <= screen_samples < samples_per_task:
            raise ValueError(
                f"screen_samples {screen_samples} must be 0 (off) or in [2, samples_per_task = {samples_per_task})"
            )
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
        # the first rollouts of a fresh task's group; the rest only when they disagree (0: whole groups at once)
        self.screen_samples = screen_samples
        self.records_config = records_config or RecordsConfig(advantage=AdvantageConfig(drop_zero_variance=True))
        self.step = 0
        self.version = engine.policy_version
        self.next_task = 0
        # which task each new group runs (None: the train tasks in order); see trainer/sampling.py
        self.sampler = sampler
        self.consumed: dict[int, dict[str, list[str]]] = {}
        self.dropped_total = 0
        self._extended: set[str] = set()  # screening groups whose rest this process enqueued
        self._read_limit = 4 * tasks_per_step + 64  # finished groups per read (grows: see _take_groups)
        self._screened_waiting = 0  # screened-out groups the last read found, consumed with the next step
        self.learner_busy_s = 0.0
        self._next_weights: tuple[Any, int] | None = None
        self._publisher: asyncio.Task[None] | None = None
        self.ops: OpsMetrics | None = None  # the job's Prometheus metrics (learner, staleness, publication)

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
        built = records_config(rl, parts.engine)
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
        self.step, self.version, self.next_task, self.consumed = ckpt.step, ckpt.version, ckpt.next_task, ckpt.consumed
        if self.sampler is not None:  # new groups continue after the last enqueued one
            self.sampler.start_at(self.next_task)
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
        consumed = self._screened_waiting + sum(
            1
            for v in self.consumed.values()
            for key in ("trained", "dropped", "screened")
            for gid in v.get(key, [])
            if not gid.endswith(REST)  # a rest group is part of its task's group, counted once
        )
        want = (1 + self.max_staleness) * self.tasks_per_step - (self.next_task - consumed)
        if want <= 0:
            return
        ks = range(self.next_task, self.next_task + want)
        if self.sampler is not None:
            tasks = [self.train_tasks[self.sampler.pick(f"train-{k}")] for k in ks]
        else:
            tasks = [self.train_tasks[k % len(self.train_tasks)] for k in ks]
        sizes = [self._first_size(f"train-{k}") for k in ks]
        i = 0
        while i < len(tasks):  # runs of equal size, in order
            j = i
            while j < len(tasks) and sizes[j] == sizes[i]:
                j += 1
            await self.store.enqueue(
                tasks[i:j],
                n=sizes[i],
                split="train",
                max_attempts=self.max_attempts,
                group_ids=[f"train-{k}" for k in ks[i:j]],
            )
            i = j
        self.next_task += want

    def _on_fresh_task(self, group_id: str) -> bool:
        """Whether the group runs a task never trained on (the sampler's word; without a sampler every group does,
        and a group the sampler does not know counts as fresh)."""
        return self.sampler is None or self.sampler.is_fresh(group_id) is not False

    def _first_size(self, group_id: str) -> int:
        """How many rollouts a new group starts with: ``screen_samples`` on a fresh task, else the whole group."""
        if not self.screen_samples:
            return self.samples_per_task
        return self.screen_samples if self._on_fresh_task(group_id) else self.samples_per_task

    def _is_screening(self, group: FinishedGroup) -> bool:
        """A group that started smaller than a whole group (and is not a rest): its first rollouts decide."""
        return (
            self.screen_samples > 0
            and group.group.n < self.samples_per_task
            and not group.group.group_id.endswith(REST)
        )

    async def _extend(self, groups: list[FinishedGroup]) -> None:
        """Enqueue the rest of each screening group whose first rollouts disagreed (idempotent on the rest's id)."""
        todo = [g for g in groups if g.group.group_id not in self._extended]
        for g in todo:
            await self.store.enqueue(
                [g.group.task],
                n=self.samples_per_task - g.group.n,
                split="train",
                max_attempts=self.max_attempts,
                group_ids=[g.group.group_id + REST],
            )
            self._extended.add(g.group.group_id)

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
                taken = self._split_fresh(finished)
                self._screened_waiting = len(taken.screened)
                await self._extend(taken.extend)
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

    def _is_stale(self, group: FinishedGroup) -> bool:
        """Sampled more than ``max_staleness`` versions ago. A grown group's rest is held to that bound and its
        screening rollouts to one version more: the rest is asked for only once they finished, and waits in the
        queue behind the groups enqueued before it."""
        gid = group.group.group_id
        rest = [d for d in group.rollouts if d.rollout.group_id != gid]
        if not rest:
            v = group_version(group)
            return v is not None and self.version - v > self.max_staleness
        first = FinishedGroup(group.group, [d for d in group.rollouts if d.rollout.group_id == gid])
        v_first, v_rest = group_version(first), group_version(FinishedGroup(group.group, rest))
        return (v_first is not None and self.version - v_first > self.max_staleness + 1) or (
            v_rest is not None and self.version - v_rest > self.max_staleness
        )

    def _split_fresh(self, finished: list[FinishedGroup]) -> Taken:
        """The oldest ``tasks_per_step`` groups within ``max_staleness`` versions (a screening group merged with
        its finished rest), every staler group, the screened-out groups and the screening groups due a rest.

        A screening group whose first rollouts disagree but that is stale already is dropped without a rest; a rest
        whose screening group is no longer waiting (dropped stale meanwhile: it finished before its rest was asked
        for, so it would be in ``finished``, which is oldest first) is dropped too."""
        by_id = {g.group.group_id: g for g in finished}
        out = Taken()
        for g in finished:
            gid = g.group.group_id
            if gid.endswith(REST):
                if gid[: -len(REST)] not in by_id:
                    out.stale.append(g)
                continue
            if self._is_screening(g):
                rest = by_id.get(gid + REST)
                if rest is None:
                    rewards = _rewards_of(g)
                    if not (len(rewards) >= 2 and max(rewards) > min(rewards)):
                        out.screened.append(g)  # never trained, however old
                    elif self._is_stale(g):  # no room left for its rest within the bound
                        out.stale.append(g)
                    else:
                        out.extend.append(g)
                    continue
                g = merge_rest(g, rest)
            if self._is_stale(g):
                out.stale.append(g)
            elif len(out.fresh) < self.tasks_per_step:
                out.fresh.append(g)
        return out

    async def train_step(self, stop: Callable[[], bool] = lambda: False) -> StepReport | None:
        """Run one training step (see the module docstring); None when ``stop()`` turned true before it could."""
        t_start = time.perf_counter()
        cpu_start = time.thread_time()
        tokens_before = self.engine.stats["tokens"]
        busy_before = _engine_busy(self.engine)
        taken, waited = await self._take_groups(stop)
        fresh, stale, screened = taken.fresh, taken.stale, taken.screened
        if len(fresh) < self.tasks_per_step:
            return None
        step = self.step + 1
        t_records = time.perf_counter()
        built = build_records(fresh, self.records_config)
        new_groups, new_outcomes = self._observe(fresh, stale, screened, built.reports)
        taught = {r.group_id for r in built.records}
        useless = [g for g in fresh if g.group.group_id not in taught] + stale + screened
        every = fresh + stale + screened
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
            "trained": [gid for g in fresh for gid in group_ids(g)],
            "dropped": [gid for g in stale for gid in group_ids(g)],
        }
        if screened:
            self.consumed[step]["screened"] = [g.group.group_id for g in screened]
        t_save = time.perf_counter()
        await asyncio.to_thread(
            save_checkpoint,
            self.run_dir,
            Checkpoint(step, new_version, self.learner.state_dict(), self.consumed, self.next_task),
        )
        await self.store.consume_groups(step, [gid for ids in self.consumed[step].values() for gid in ids])
        self.step = step
        self._screened_waiting = 0
        self._extended.difference_update(self.consumed[step]["trained"] + self.consumed[step]["dropped"])
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
        if self.ops is not None:
            trained = bool(built.records)
            self.ops.training_step(learner_s if trained else None, publish_s if trained else None, staleness)
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
            screened_groups=len(screened),
            rollouts=sum(len(g.rollouts) for g in every),
            wasted_rollouts=sum(len(g.rollouts) for g in useless),
            generated_tokens=sum(map(generated_tokens, every)),
            wasted_tokens=sum(map(generated_tokens, useless)),
            fresh_success_rate=(sum(new_outcomes) / len(new_outcomes)) if new_outcomes else None,
            metrics=metrics,
            fresh_outcomes=new_outcomes,
        )

    def _observe(
        self,
        fresh: list[FinishedGroup],
        stale: list[FinishedGroup],
        screened: list[FinishedGroup],
        reports: Sequence[Any],
    ) -> tuple[int, list[float]]:
        """Tell the sampler each consumed group's rewards; returns (trained groups on never-trained tasks, the
        outcomes of the fresh tasks' rollouts). Without a sampler every group counts as fresh. A screened or grown
        group gives only its screening rollouts' outcomes, so each fresh task counts the same number of them."""
        by_rollout: dict[str, float] = {}
        for r in reports:
            if r.final_reward is not None:  # the outcome: per-call rewards would count a half-fixed task as solved
                by_rollout[r.rollout_id] = float(r.final_reward)
        n_new, outcomes = 0, []
        for g in fresh:
            gid = g.group.group_id
            rewards = [by_rollout[d.rollout.rollout_id] for d in g.rollouts if d.rollout.rollout_id in by_rollout]
            if self._on_fresh_task(gid):
                n_new += 1
                first = [d for d in g.rollouts if d.rollout.group_id == gid]  # without the rest, if any
                outcomes += [
                    1.0 if by_rollout[d.rollout.rollout_id] > 0 else 0.0
                    for d in first
                    if d.rollout.rollout_id in by_rollout
                ]
            if self.sampler is not None:
                self.sampler.observe(gid, rewards)
        for g in screened:
            rewards = _rewards_of(g)
            if self._on_fresh_task(g.group.group_id):
                outcomes += [1.0 if r > 0 else 0.0 for r in rewards]
            if self.sampler is not None:
                self.sampler.observe(g.group.group_id, rewards)
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
    running: RLWorkers | None = None,
    generate_during_checks: bool = False,
) -> RLResult:
    """RL with in-process workers until ``steps``, ``deadline`` or ``stop()`` (``RunStopped``). With a ``target``,
    RL pauses whenever the target is due: the workers release their attempts, ``held_out(split, label)`` evaluates
    the newest weights, and RL ends when the gain is confirmed, else goes on (``on_rl`` is told). ``running``:
    workers already started (``RLWorkers.start``) that serve the first stretch of RL; run_rl closes them. With
    ``generate_during_checks`` the workers go on generating train groups during the checks (on the weights being
    checked; the learner is paused, so nothing is published meanwhile): the steps after a check find their groups
    ready instead of waiting for what the pause did not generate and for the attempts it released."""
    t_rl = time.perf_counter()
    t_start = t_rl if t_start is None else t_start
    checks: list[dict[str, Any]] = []
    pause = target.due if target is not None else never

    def stop_or_pause() -> bool:
        return stop() or pause()

    try:
        while True:
            if running is None:
                running = await RLWorkers.start(loop, agent, workers)
            await loop.train_steps(steps, deadline=deadline, on_step=on_step, stop=stop_or_pause)
            if stop():
                raise RunStopped(loop.step)
            if target is None or not target.due():
                break
            if not generate_during_checks:  # the check runs alone; the next stretch starts new workers
                await running.close()
                running = None
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
    finally:
        if running is not None:  # they release their in-flight attempts
            await running.close()
    await loop.flush_weights()
    return RLResult(checks, None, time.perf_counter() - t_rl)


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
