"""Which train task the next group runs: fresh tasks in order, mixed with replays of tasks that recently taught.

A GRPO group teaches nothing when all its rollouts score the same (zero reward variance: the task is too easy or too
hard for the current policy); on the calc example half of the generated groups were such. A task whose last group
*did* have variance sits near the policy's frontier, so another group on it is likely to teach again. The sampler
keeps a queue of such tasks and draws ``replay_share`` of the new groups from it (each task at most ``max_replays``
times in a row of informative groups), the rest from the fresh tasks in order.

Fresh groups are marked, so the trainer can measure the policy's sampled success on tasks it never trained on
(``fresh_success``), free of the replays' selection.

The state (which group ran which task, the replay queue) lives in memory: after a resume the sampler starts again
from the checkpoint's task counter with an empty queue, which only costs the replays it had planned.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence

__all__ = ["TaskSampler"]


class TaskSampler:
    """Picks the task index of each new group and learns from the rewards of finished groups."""

    def __init__(
        self, n_tasks: int, *, replay_share: float = 0.5, max_replays: int = 2, start: int = 0, seed: int = 0
    ) -> None:
        if n_tasks <= 0:
            raise ValueError("TaskSampler needs at least one task")
        if not 0.0 <= replay_share <= 1.0:
            raise ValueError(f"replay_share {replay_share} is not in [0, 1]")
        self.n_tasks = n_tasks
        self.replay_share = replay_share
        self.max_replays = max_replays
        self._cursor = start
        self._rng = random.Random(seed)
        self._task_of: dict[str, int] = {}
        self._replays_of: dict[str, int] = {}  # group id -> how many replays led to it (0: fresh)
        self._queue: deque[tuple[int, int]] = deque()  # (task index, replays so far)
        self.picked_fresh = 0
        self.picked_replay = 0

    def pick(self, group_id: str) -> int:
        """The task index the group ``group_id`` runs (remembered for ``observe``)."""
        if self._queue and self._rng.random() < self.replay_share:
            task, replays = self._queue.popleft()
            replays += 1
            self.picked_replay += 1
        else:
            task, replays = self._cursor % self.n_tasks, 0
            self._cursor += 1
            self.picked_fresh += 1
        self._task_of[group_id] = task
        self._replays_of[group_id] = replays
        return task

    def is_fresh(self, group_id: str) -> bool | None:
        """Whether the group ran a task for the first time (None: not picked by this sampler, e.g. before a resume)."""
        replays = self._replays_of.get(group_id)
        return None if replays is None else replays == 0

    def observe(self, group_id: str, rewards: Sequence[float]) -> None:
        """A finished group's rewards: an informative one (rewards differ) queues its task for a replay."""
        task = self._task_of.pop(group_id, None)
        replays = self._replays_of.pop(group_id, 0)
        if task is None or len(rewards) < 2:
            return
        if max(rewards) > min(rewards) and replays < self.max_replays:
            self._queue.append((task, replays))

    @property
    def queued(self) -> int:
        return len(self._queue)

    def start_at(self, cursor: int) -> None:
        """Continue the fresh tasks from ``cursor`` (the daemon's task counter after a resume)."""
        self._cursor = cursor
