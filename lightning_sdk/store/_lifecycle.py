"""The lifecycle moves of the store as pure functions over the data model (no I/O).

Every store (memory, SQLite) reads the current objects, calls one of these functions and writes back what it
returns, so the rules live here once: ``check_rollout_transition`` / ``check_attempt_transition`` run on every move,
``attempts_used`` is counted the same way everywhere, and a finished attempt decides the rollout's next status here.

Counting rule: a claim counts an attempt against ``max_attempts`` at once (``attempts_used += 1``); a released
attempt gives it back (``attempts_used -= 1``), so released attempts never count.
"""

from __future__ import annotations

import base64
import secrets
import threading
from collections.abc import Iterable

from lightning_sdk.errors import ConfigError, InvalidTransitionError, NotFoundError
from lightning_sdk.types import (
    TERMINAL_ROLLOUT,
    Attempt,
    AttemptStatus,
    Call,
    FinishedGroup,
    Group,
    Rollout,
    RolloutStatus,
    Task,
    check_attempt_transition,
    check_rollout_transition,
    new_id,
)

__all__ = [
    "LEASE_EXPIRED",
    "ROLLOUT_STATUSES",
    "FinishedCache",
    "cancel",
    "check_consumable",
    "check_lease_s",
    "check_limit",
    "check_owner",
    "decode_cursor",
    "encode_cursor",
    "end_attempt",
    "extend_lease",
    "group_finished",
    "join_group",
    "lease_expired",
    "new_group",
    "new_rollouts",
    "new_token",
    "open_session_objects",
    "split_resent",
    "start_attempt",
    "validate_enqueue",
]

ROLLOUT_STATUSES: tuple[str, ...] = tuple(s.value for s in RolloutStatus)
LEASE_EXPIRED = "lease expired"  # the error of an attempt whose lease ran out


def new_token() -> str:
    """An unguessable attempt token (256 bits from ``secrets``)."""
    return "lsk-" + secrets.token_urlsafe(32)


def validate_enqueue(tasks: list[Task], n: int, max_attempts: int, split: str, group_ids: list[str] | None) -> None:
    """Raise ``ConfigError`` for arguments no store can accept."""
    if n < 1:
        raise ConfigError(f"enqueue: n must be >= 1, got {n}")
    if max_attempts < 1:
        raise ConfigError(f"enqueue: max_attempts must be >= 1, got {max_attempts}")
    if not split:
        raise ConfigError("enqueue: split must be a non-empty string")
    for i, task in enumerate(tasks):
        if not isinstance(task, dict):
            raise ConfigError(f"enqueue: tasks[{i}] must be a JSON object (dict), got {type(task).__name__}")
    if group_ids is not None:
        if len(group_ids) != len(tasks):
            raise ConfigError(f"enqueue: {len(group_ids)} group_ids for {len(tasks)} tasks")
        if len(set(group_ids)) != len(group_ids):
            raise ConfigError("enqueue: group_ids must be distinct")
        if any(not g for g in group_ids):
            raise ConfigError("enqueue: group_ids must be non-empty strings")


def check_lease_s(lease_s: float, op: str) -> None:
    if lease_s <= 0:
        raise ConfigError(f"{op}: lease_s must be > 0, got {lease_s}")


def check_limit(limit: int, op: str) -> None:
    if limit < 1:
        raise ConfigError(f"{op}: limit must be >= 1, got {limit}")


def check_owner(what: str, attempt_id: str, rollout_id: str, owner: str | None) -> None:
    """A call or reward names attempt ``attempt_id`` of rollout ``rollout_id``; ``owner`` is the rollout that attempt
    really belongs to (None: no such attempt)."""
    if owner is None:
        raise NotFoundError(f"{what}: no attempt {attempt_id!r}")
    if owner != rollout_id:
        raise ConfigError(f"{what}: attempt {attempt_id} belongs to rollout {owner}, not {rollout_id}")


def join_group(group: Group) -> Group:
    """``group`` with one more rollout (a session opened into it); a consumed group takes no more."""
    if group.consumed_step is not None:
        raise InvalidTransitionError(f"group {group.group_id}: already consumed, cannot add a session to it")
    return group.model_copy(update={"n": group.n + 1})


def lease_expired(attempt: Attempt, ts: float) -> bool:
    """A running attempt whose lease ran out by ``ts`` (a session without a lease never expires)."""
    return (
        attempt.status is AttemptStatus.RUNNING
        and attempt.lease_expires_at is not None
        and (attempt.lease_expires_at <= ts)
    )


def new_group(task: Task, n: int, split: str, group_id: str | None, ts: float) -> Group:
    return Group(group_id=group_id or new_id("gr"), task=task, n=n, split=split, created_at=ts)


def new_rollouts(group: Group, count: int, max_attempts: int, ts: float) -> list[Rollout]:
    """``count`` queued rollouts of ``group``."""
    return [
        Rollout(
            rollout_id=new_id("ro"),
            group_id=group.group_id,
            task=group.task,
            split=group.split,
            status=RolloutStatus.QUEUED,
            max_attempts=max_attempts,
            attempts_used=0,
            created_at=ts,
            updated_at=ts,
        )
        for _ in range(count)
    ]


def start_attempt(
    rollout: Rollout, index: int, worker_id: str | None, lease_expires_at: float | None, ts: float
) -> tuple[Rollout, Attempt]:
    """queued -> running with a new running attempt (counted against ``max_attempts``)."""
    check_rollout_transition(rollout.rollout_id, rollout.status, RolloutStatus.RUNNING)
    if rollout.attempts_used >= rollout.max_attempts:
        raise InvalidTransitionError(
            f"rollout {rollout.rollout_id}: all {rollout.max_attempts} attempts used; cannot start another"
        )
    new_rollout = rollout.model_copy(
        update={"status": RolloutStatus.RUNNING, "attempts_used": rollout.attempts_used + 1, "updated_at": ts}
    )
    attempt = Attempt(
        attempt_id=new_id("at"),
        rollout_id=rollout.rollout_id,
        index=index,
        token=new_token(),
        status=AttemptStatus.RUNNING,
        worker_id=worker_id,
        lease_expires_at=lease_expires_at,
        started_at=ts,
    )
    return new_rollout, attempt


def open_session_objects(group: Group, ts: float) -> tuple[Rollout, Attempt]:
    """A rollout of ``group`` that is running at once with its first attempt (no lease, max_attempts 1)."""
    (rollout,) = new_rollouts(group, 1, 1, ts)
    return start_attempt(rollout, 0, None, None, ts)


def end_attempt(
    rollout: Rollout, attempt: Attempt, status: AttemptStatus, error: str | None, ts: float
) -> tuple[Rollout, Attempt]:
    """running attempt -> ``status``, and the rollout's consequent move.

    succeeded -> rollout succeeded; failed / timed_out -> queued again while attempts remain, else failed;
    released -> gives its attempt back and the rollout is queued again.
    """
    check_attempt_transition(attempt.attempt_id, attempt.status, status)
    new_attempt = attempt.model_copy(update={"status": status, "error": error, "ended_at": ts})
    used = rollout.attempts_used
    if status is AttemptStatus.SUCCEEDED:
        target = RolloutStatus.SUCCEEDED
    else:
        if status is AttemptStatus.RELEASED:
            used = max(0, used - 1)
        target = RolloutStatus.QUEUED if used < rollout.max_attempts else RolloutStatus.FAILED
    check_rollout_transition(rollout.rollout_id, rollout.status, target)
    new_rollout = rollout.model_copy(update={"status": target, "attempts_used": used, "updated_at": ts})
    return new_rollout, new_attempt


def extend_lease(attempt: Attempt, lease_s: float, ts: float) -> Attempt:
    """A running attempt with its lease moved to ``ts + lease_s`` (a session without a lease keeps none)."""
    if attempt.status is not AttemptStatus.RUNNING:
        raise InvalidTransitionError(
            f"attempt {attempt.attempt_id}: cannot heartbeat, it is {attempt.status.value!r}, not 'running'"
        )
    check_lease_s(lease_s, "heartbeat")
    if attempt.lease_expires_at is None:
        return attempt
    return attempt.model_copy(update={"lease_expires_at": ts + lease_s})


def cancel(rollout: Rollout, ts: float) -> Rollout:
    """queued -> cancelled."""
    check_rollout_transition(rollout.rollout_id, rollout.status, RolloutStatus.CANCELLED)
    return rollout.model_copy(update={"status": RolloutStatus.CANCELLED, "updated_at": ts})


def group_finished(statuses: Iterable[RolloutStatus]) -> bool:
    """True when the group has rollouts and all of them are terminal."""
    seen = False
    for s in statuses:
        seen = True
        if s not in TERMINAL_ROLLOUT:
            return False
    return seen


def check_consumable(group_id: str, group: Group | None, statuses: Iterable[RolloutStatus], step: int) -> bool:
    """True if ``step`` newly consumes ``group``; False if ``step`` already did; raises otherwise (``NotFoundError``
    when there is no such group)."""
    if group is None:
        raise NotFoundError(f"no group {group_id!r}")
    if group.consumed_step == step:
        return False
    if group.consumed_step is not None:
        raise InvalidTransitionError(
            f"group {group.group_id}: already consumed by step {group.consumed_step}, cannot consume at step {step}"
        )
    if not group_finished(statuses):
        raise InvalidTransitionError(f"group {group.group_id}: not every rollout is finished, cannot consume it")
    return True


# -- cursors ---------------------------------------------------------------------------------------------------------
def encode_cursor(seq: int) -> str:
    """An opaque cursor for the position after creation sequence number ``seq``."""
    return base64.urlsafe_b64encode(f"r1:{seq}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str | None) -> int:
    """The creation sequence number a cursor points after (0 for None); ``ConfigError`` if it is not ours."""
    if cursor is None or cursor == "":
        return 0
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        prefix, _, number = raw.partition(":")
        if prefix != "r1":
            raise ValueError(prefix)
        return int(number)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"invalid cursor {cursor!r}") from exc


def split_resent(calls: list[Call]) -> tuple[list[Call], list[Call]]:
    """A batch of calls as (new calls, re-sent calls). A call with an ``idempotency_key`` may be a re-sent one: its
    id is derived from its attempt and key (``proxy._call.resent_call_id``), so an id already stored is the same
    logical call made again (the agent never got the first answer) and the store replaces that record with it,
    keeping the stored ``seq`` (the call's place in its attempt); one record per (attempt, key), the last one made
    (the answer the agent used). Any other call keeps the first record of its id (a batch committed twice)."""
    plain = [c for c in calls if c.idempotency_key is None]
    if len(plain) == len(calls):
        return calls, []
    return plain, [c for c in calls if c.idempotency_key is not None]


class FinishedCache:
    """The finished, unconsumed groups a store already loaded with their details (``finished_groups``), by id.

    The trainer reads the finished groups again each time attempts end, until it has a step's worth: every read
    loaded every waiting group's rollouts, attempts, calls and rewards again (JSON and model validation of each
    call: ~13% of a core in the calc example's RL phase). A finished group does not change until it is consumed
    (its rollouts are all terminal; rewards and calls come only through running attempts) or a session joins it,
    which changes its row (``n``, ``join_group``): a read loads the details only of groups that are new or whose row
    changed, and forgets those no longer finished and unconsumed in the split it read."""

    def __init__(self) -> None:
        self._groups: dict[str, FinishedGroup] = {}
        self._lock = threading.Lock()  # a PostgreSQL store reads from any thread's event loop

    def lookup(self, groups: list[Group]) -> tuple[dict[str, FinishedGroup], list[Group]]:
        """Of ``groups`` (the ready rows of one read): those loaded before with the same row, by id (a snapshot: a
        concurrent read may forget entries meanwhile), and the others, whose details must be loaded."""
        with self._lock:
            known = {
                g.group_id: fg for g in groups if (fg := self._groups.get(g.group_id)) is not None and fg.group == g
            }
        return known, [g for g in groups if g.group_id not in known]

    def answer(
        self, split: str, groups: list[Group], known: dict[str, FinishedGroup], loaded: list[FinishedGroup]
    ) -> list[FinishedGroup]:
        """``groups`` with their details (``known`` before, or ``loaded`` now); the split's other entries are
        forgotten."""
        now = {**known, **{fg.group.group_id: fg for fg in loaded}}
        ready = {g.group_id for g in groups}
        with self._lock:
            self._groups.update((fg.group.group_id, fg) for fg in loaded)
            for gid in [gid for gid, fg in self._groups.items() if fg.group.split == split and gid not in ready]:
                del self._groups[gid]
        return [now[g.group_id] for g in groups]

    def __len__(self) -> int:
        return len(self._groups)
