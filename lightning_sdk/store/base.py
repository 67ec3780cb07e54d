"""The store interface: one async API over SQLite (default), memory (tests) and HTTP (remote workers).

Every implementation enforces the lifecycle tables of ``lightning_sdk.types`` on every change and raises the
errors of ``lightning_sdk.errors`` (``NotFoundError``, ``InvalidTransitionError``, ``StoreUnavailableError``).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from lightning_sdk.store._events import AttemptEnds
from lightning_sdk.types import (
    Attempt,
    AttemptStatus,
    Call,
    Claim,
    FinishedGroup,
    Group,
    PolicyVersion,
    Resource,
    Reward,
    Rollout,
    RolloutDetail,
    RolloutStatus,
    Task,
)

__all__ = ["FinishedGroup", "Store"]


@runtime_checkable
class Store(Protocol):
    @property
    def attempt_ends(self) -> AttemptEnds | None:
        """Bumped whenever an attempt ends (``store/_events.py``): what the trainer waits on before reading finished
        groups; None where this process cannot see the ends (a remote store), which is then polled."""
        ...

    # -- tasks, groups, rollouts ------------------------------------------------------------------------------
    async def enqueue(
        self,
        tasks: list[Task],
        *,
        n: int = 1,
        max_attempts: int = 1,
        split: str = "train",
        group_ids: list[str] | None = None,
    ) -> list[Group]:
        """One group of ``n`` queued rollouts per task. Idempotent on client-supplied ``group_ids``."""
        ...

    async def open_session(
        self, task: Task | None = None, group_id: str | None = None, *, split: str = "train"
    ) -> Claim:
        """A running rollout and its first attempt outside any queue (tracing by hand); no lease. A new group gets
        ``split``; joining an existing group keeps its split."""
        ...

    async def claim(self, worker_id: str, *, lease_s: float = 60.0, split: str | None = None) -> Claim | None:
        """Move the oldest queued rollout to running with a new attempt leased to ``worker_id``; None if none."""
        ...

    async def heartbeat(self, attempt_id: str, *, lease_s: float = 60.0) -> Attempt:
        """Extend a running attempt's lease. Raises ``InvalidTransitionError`` if it is no longer running."""
        ...

    async def finish_attempt(self, attempt_id: str, status: AttemptStatus, error: str | None = None) -> Attempt:
        """End an attempt (after its calls and rewards are committed). A failed/timed-out/released attempt makes
        the rollout queued again while attempts remain, else failed; a succeeded one makes it succeeded."""
        ...

    async def expire_leases(self) -> list[Attempt]:
        """Time out every running attempt whose lease has expired; returns them."""
        ...

    async def cancel_rollout(self, rollout_id: str) -> Rollout:
        """queued -> cancelled. Raises ``InvalidTransitionError`` for a rollout that is not queued."""
        ...

    async def get_attempt(self, attempt_id: str) -> Attempt:
        """One attempt by id. Raises ``NotFoundError``."""
        ...

    # -- calls and rewards ---------------------------------------------------------------------------------------
    async def attempt_by_token(self, token: str) -> Attempt | None:
        """The attempt that owns ``token`` (any status), None if unknown. Cheap: the proxy calls it per request."""
        ...

    async def record_calls(self, calls: list[Call]) -> None:
        """Commit calls (idempotent on call_id). A call with an ``idempotency_key`` whose id is stored was re-sent by
        the agent: it replaces the stored record, keeping the stored ``seq`` (``_lifecycle.split_resent``)."""
        ...

    async def record_rewards(self, rewards: list[Reward]) -> None:
        """Commit rewards; one per (attempt, name, call_id): recording the same key again replaces the value."""
        ...

    # -- reading -----------------------------------------------------------------------------------------------
    async def get_rollout(self, rollout_id: str) -> RolloutDetail: ...

    async def list_rollouts(
        self, *, status: RolloutStatus | None = None, limit: int = 100, after: str | None = None
    ) -> tuple[list[Rollout], str | None]:
        """A page of rollouts in creation order and the cursor of the next page (None at the end)."""
        ...

    async def list_rollout_details(
        self, *, limit: int = 100, after: str | None = None
    ) -> tuple[list[RolloutDetail], str | None]:
        """``list_rollouts`` with each rollout's attempts, calls and rewards: one read per page (for export)."""
        ...

    async def list_group_details(
        self, *, split: str | None = None, limit: int = 64, after: str | None = None
    ) -> tuple[list[FinishedGroup], str | None]:
        """A page of groups (of ``split``; None = every split) in creation order, each with every rollout's
        attempts, calls and rewards (consumed or not, any status), and the cursor of the next page (None at the
        end): one read per page, so an export streams the store a bounded page at a time."""
        ...

    async def counts(self) -> dict[str, int]:
        """Rollouts by status plus ``groups_ready`` (finished, unconsumed train groups)."""
        ...

    # -- training ----------------------------------------------------------------------------------------------
    async def finished_groups(self, *, limit: int = 64, split: str = "train") -> list[FinishedGroup]:
        """Groups whose rollouts are all terminal and not consumed, oldest first."""
        ...

    async def consume_groups(self, step: int, group_ids: list[str]) -> list[str]:
        """Mark groups consumed by training step ``step``; idempotent (the same step twice changes nothing).
        Returns the ids newly consumed. A group consumed by another step raises ``InvalidTransitionError``."""
        ...

    async def publish_version(self, version: PolicyVersion) -> None: ...

    async def current_version(self) -> PolicyVersion | None: ...

    async def set_resource(self, resource: Resource) -> None: ...

    async def get_resources(self) -> list[Resource]: ...

    async def set_meta(self, key: str, value: Any) -> None:
        """Small JSON key-value state (e.g. the trainer's checkpoint pointer)."""
        ...

    async def get_meta(self, key: str) -> Any | None: ...

    async def close(self) -> None: ...
