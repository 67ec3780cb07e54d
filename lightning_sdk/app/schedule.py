"""Which groups the training loop runs next, and what a read of the finished groups holds: the task scheduling of
``app/loop.py``, apart from the training step.

- **The feed** (``Schedule.feed``): enqueue train tasks (client-chosen group ids ``train-<k>``, so a restart never
  enqueues one twice) to keep about ``(1 + max_staleness) * tasks_per_step`` groups outstanding (not yet trained,
  dropped or screened out). Which task a group runs: the train tasks in order, or the ``TaskSampler``'s pick
  (``trainer/sampling.py``: a share of replays of tasks whose last group had reward variance).
- **Screening** (``screen_samples`` = k > 0): a group on a task never run before starts with k rollouts. When its
  k rewards all agree it is *screened out*: consumed with the next step, never trained, its generation stopped at
  k of ``samples_per_task``. When they differ, ``extend`` enqueues the rest of the group (``samples_per_task - k``
  rollouts, group id ``train-<k>-rest``, idempotent) and ``split`` trains both as one group of
  ``samples_per_task`` rollouts once both finished: the advantages see all of them, the screening rollouts first.
  Every decision is a function of what the store holds (group sizes, finished rollouts, rewards), so a restart
  takes it again and asks for a rest group that already exists, which is a no-op. Replays run full groups at once.
  Screened-out groups do not count towards ``tasks_per_step``. Staleness: the rest is asked for only once the
  first rollouts finished and waits behind the groups already queued, so a grown group's first rollouts may be one
  version older than ``max_staleness`` (its rest is held to the bound).
- **What a step's groups teach the sampler** (``observe``): each consumed group's rewards, and the outcomes of the
  fresh tasks' rollouts that the target check watches (only the k screening rollouts of each fresh task, screened
  out or not, so every task weighs the same whatever its group grew to).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_sdk.agent.tasks import rollout_reward
from lightning_sdk.store.base import Store
from lightning_sdk.trainer.sampling import TaskSampler
from lightning_sdk.types import FinishedGroup

__all__ = ["REST", "Schedule", "Taken", "generated_tokens", "group_ids", "group_version", "merge_rest"]


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


def _rewards_of(group: FinishedGroup) -> list[float]:
    """The final reward of each rollout's succeeded attempt (rollouts without one are left out)."""
    return [r for r in map(rollout_reward, group.rollouts) if r is not None]


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


class Schedule:
    """The task scheduling of one training loop over ``store`` (see the module docstring). ``next_task`` counts the
    train groups enqueued so far (checkpointed by the loop); ``sampler`` None runs the train tasks in order."""

    def __init__(
        self,
        store: Store,
        train_tasks: Sequence[dict[str, Any]] = (),
        *,
        tasks_per_step: int = 16,
        samples_per_task: int = 8,
        max_staleness: int = 1,
        screen_samples: int = 0,
        sampler: TaskSampler | None = None,
        max_attempts: int = 1,
    ) -> None:
        if screen_samples and not 2 <= screen_samples < samples_per_task:
            raise ValueError(
                f"screen_samples {screen_samples} must be 0 (off) or in [2, samples_per_task = {samples_per_task})"
            )
        self.store = store
        self.train_tasks = list(train_tasks)
        self.tasks_per_step = tasks_per_step
        self.samples_per_task = samples_per_task
        self.max_staleness = max_staleness
        # the first rollouts of a fresh task's group; the rest only when they disagree (0: whole groups at once)
        self.screen_samples = screen_samples
        # which task each new group runs (None: the train tasks in order); see trainer/sampling.py
        self.sampler = sampler
        self.max_attempts = max_attempts  # tries per train rollout (a crashed attempt is retried, never trained)
        self.next_task = 0
        self.screened_waiting = 0  # screened-out groups the last read found, consumed with the next step
        self._extended: set[str] = set()  # screening groups whose rest this process enqueued

    def resume_at(self, next_task: int) -> None:
        """Continue after a checkpoint: new groups start at ``next_task`` (the sampler's fresh tasks too)."""
        self.next_task = next_task
        if self.sampler is not None:
            self.sampler.start_at(next_task)

    def consumed(self, groups: Sequence[str]) -> None:
        """A step consumed ``groups``: the screened-out groups waiting for it are gone, and a rest is never asked for
        again for a group that was trained or dropped."""
        self.screened_waiting = 0
        self._extended.difference_update(groups)

    async def feed(self, consumed: Mapping[int, Mapping[str, list[str]]]) -> None:
        """Enqueue train tasks until ``(1 + max_staleness) * tasks_per_step`` groups are outstanding (enqueued, not
        yet in ``consumed``: the loop's record of the groups each step trained, dropped or screened out)."""
        if not self.train_tasks:
            return
        done = self.screened_waiting + sum(
            1
            for v in consumed.values()
            for key in ("trained", "dropped", "screened")
            for gid in v.get(key, [])
            if not gid.endswith(REST)  # a rest group is part of its task's group, counted once
        )
        want = (1 + self.max_staleness) * self.tasks_per_step - (self.next_task - done)
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

    def on_fresh_task(self, group_id: str) -> bool:
        """Whether the group runs a task never trained on (the sampler's word; without a sampler every group does,
        and a group the sampler does not know counts as fresh)."""
        return self.sampler is None or self.sampler.is_fresh(group_id) is not False

    def _first_size(self, group_id: str) -> int:
        """How many rollouts a new group starts with: ``screen_samples`` on a fresh task, else the whole group."""
        if not self.screen_samples:
            return self.samples_per_task
        return self.screen_samples if self.on_fresh_task(group_id) else self.samples_per_task

    def _is_screening(self, group: FinishedGroup) -> bool:
        """A group that started smaller than a whole group (and is not a rest): its first rollouts decide."""
        return (
            self.screen_samples > 0
            and group.group.n < self.samples_per_task
            and not group.group.group_id.endswith(REST)
        )

    async def extend(self, groups: list[FinishedGroup]) -> None:
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

    def _is_stale(self, group: FinishedGroup, version: int) -> bool:
        """Sampled more than ``max_staleness`` versions ago. A grown group's rest is held to that bound and its
        screening rollouts to one version more: the rest is asked for only once they finished, and waits in the
        queue behind the groups enqueued before it."""
        gid = group.group.group_id
        rest = [d for d in group.rollouts if d.rollout.group_id != gid]
        if not rest:
            v = group_version(group)
            return v is not None and version - v > self.max_staleness
        first = FinishedGroup(group.group, [d for d in group.rollouts if d.rollout.group_id == gid])
        v_first, v_rest = group_version(first), group_version(FinishedGroup(group.group, rest))
        return (v_first is not None and version - v_first > self.max_staleness + 1) or (
            v_rest is not None and version - v_rest > self.max_staleness
        )

    def split(self, finished: list[FinishedGroup], version: int) -> Taken:
        """What a read of the finished groups holds at policy ``version``: the oldest ``tasks_per_step`` groups
        within ``max_staleness`` versions (a screening group merged with
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
                    elif self._is_stale(g, version):  # no room left for its rest within the bound
                        out.stale.append(g)
                    else:
                        out.extend.append(g)
                    continue
                g = merge_rest(g, rest)
            if self._is_stale(g, version):
                out.stale.append(g)
            elif len(out.fresh) < self.tasks_per_step:
                out.fresh.append(g)
        return out

    def observe(
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
            if self.on_fresh_task(gid):
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
            if self.on_fresh_task(g.group.group_id):
                outcomes += [1.0 if r > 0 else 0.0 for r in rewards]
            if self.sampler is not None:
                self.sampler.observe(g.group.group_id, rewards)
        if self.sampler is not None:
            for g in stale:  # still a sign of which tasks sit at the frontier
                self.sampler.observe(g.group.group_id, _rewards_of(g))
        return n_new, outcomes
