"""``MemoryStore``: the whole store in Python dicts, for tests and throwaway runs (nothing survives the process).

Every method does its work without awaiting in between, so each operation is atomic with respect to other
coroutines on the loop; a ``threading.Lock`` also makes it safe to share between threads or event loops. Objects
go in and come out as copies, so callers can never change the stored state by mutating what they hold.
"""

from __future__ import annotations

import threading
from typing import Any

import orjson

from lightning_sdk.errors import ConfigError, NotFoundError
from lightning_sdk.store import _lifecycle as lc
from lightning_sdk.store._clock import Clock, system_clock
from lightning_sdk.store._events import AttemptEnds
from lightning_sdk.types import (
    Attempt,
    AttemptDetail,
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

__all__ = ["MemoryStore"]


class MemoryStore:
    """The ``Store`` protocol in memory (see ``lightning_sdk.store.base``)."""

    def __init__(self, *, clock: Clock = system_clock) -> None:
        self.clock = clock  # what "now" is for leases (tests drive a ManualClock)
        self._lock = threading.Lock()
        self._groups: dict[str, Group] = {}  # insertion order = creation order
        self._group_order: list[str] = []  # group ids in creation order (positions are list cursors)
        self._group_rollouts: dict[str, list[str]] = {}
        self._rollouts: dict[str, Rollout] = {}
        self._rollout_seq: dict[str, int] = {}
        self._seq = 0
        self._attempts: dict[str, Attempt] = {}
        self._rollout_attempts: dict[str, list[str]] = {}
        self._tokens: dict[str, str] = {}  # token -> attempt_id
        self._calls: dict[str, Call] = {}
        self._attempt_calls: dict[str, list[str]] = {}
        self._rewards: dict[str, dict[tuple[str, str], Reward]] = {}  # attempt_id -> (name, call_id or "") -> reward
        self._versions: dict[int, PolicyVersion] = {}
        self._resources: dict[str, Resource] = {}
        self._meta: dict[str, bytes] = {}
        self._closed = False
        self.attempt_ends = AttemptEnds()  # bumped when attempts end: the trainer waits on it (store/_events.py)

    # -- helpers -------------------------------------------------------------------------------------------------
    def _rollout(self, rollout_id: str) -> Rollout:
        try:
            return self._rollouts[rollout_id]
        except KeyError:
            raise NotFoundError(f"no rollout {rollout_id!r}") from None

    def _owner(self, attempt_id: str) -> str | None:
        attempt = self._attempts.get(attempt_id)
        return None if attempt is None else attempt.rollout_id

    def _attempt(self, attempt_id: str) -> Attempt:
        try:
            return self._attempts[attempt_id]
        except KeyError:
            raise NotFoundError(f"no attempt {attempt_id!r}") from None

    def _add_rollout(self, rollout: Rollout) -> None:
        self._seq += 1
        self._rollouts[rollout.rollout_id] = rollout
        self._rollout_seq[rollout.rollout_id] = self._seq
        self._group_rollouts.setdefault(rollout.group_id, []).append(rollout.rollout_id)

    def _add_attempt(self, attempt: Attempt) -> None:
        self._attempts[attempt.attempt_id] = attempt
        self._rollout_attempts.setdefault(attempt.rollout_id, []).append(attempt.attempt_id)
        self._tokens[attempt.token] = attempt.attempt_id

    def _detail(self, rollout_id: str) -> RolloutDetail:
        rollout = self._rollout(rollout_id)
        attempts = []
        for attempt_id in self._rollout_attempts.get(rollout_id, []):
            calls = sorted(
                (self._calls[c] for c in self._attempt_calls.get(attempt_id, [])), key=lambda c: (c.seq, c.started_at)
            )
            rewards = sorted(self._rewards.get(attempt_id, {}).values(), key=lambda r: r.created_at)
            attempts.append(
                AttemptDetail(
                    attempt=self._attempts[attempt_id].model_copy(),
                    calls=[_copy_call(c) for c in calls],
                    rewards=[r.model_copy() for r in rewards],
                )
            )
        return RolloutDetail(rollout=rollout.model_copy(update={"task": _copy_json(rollout.task)}), attempts=attempts)

    def _end(self, attempt_id: str, status: AttemptStatus, error: str | None, ts: float) -> Attempt:
        attempt = self._attempt(attempt_id)
        rollout, new_attempt = lc.end_attempt(self._rollout(attempt.rollout_id), attempt, status, error, ts)
        self._rollouts[rollout.rollout_id] = rollout
        self._attempts[attempt_id] = new_attempt
        return new_attempt

    # -- tasks, groups, rollouts ---------------------------------------------------------------------------------
    async def enqueue(
        self,
        tasks: list[Task],
        *,
        n: int = 1,
        max_attempts: int = 1,
        split: str = "train",
        group_ids: list[str] | None = None,
    ) -> list[Group]:
        lc.validate_enqueue(tasks, n, max_attempts, split, group_ids)
        ts = self.clock()
        out: list[Group] = []
        with self._lock:
            for i, task in enumerate(tasks):
                gid = group_ids[i] if group_ids is not None else None
                if gid is not None and gid in self._groups:
                    out.append(self._groups[gid].model_copy(deep=True))
                    continue
                group = lc.new_group(_copy_json(task), n, split, gid, ts)
                self._groups[group.group_id] = group
                self._group_order.append(group.group_id)
                for rollout in lc.new_rollouts(group, n, max_attempts, ts):
                    self._add_rollout(rollout)
                out.append(group.model_copy(deep=True))
        return out

    async def open_session(
        self, task: Task | None = None, group_id: str | None = None, *, split: str = "train"
    ) -> Claim:
        ts = self.clock()
        with self._lock:
            group = self._groups.get(group_id) if group_id is not None else None
            if group is None:
                group = lc.new_group(_copy_json(task or {}), 1, split, group_id, ts)
                self._group_order.append(group.group_id)
            else:
                group = lc.join_group(group)
            rollout, attempt = lc.open_session_objects(group, ts)
            if task is not None:
                rollout = rollout.model_copy(update={"task": _copy_json(task)})
            self._groups[group.group_id] = group
            self._add_rollout(rollout)
            self._add_attempt(attempt)
            return Claim(rollout=rollout, attempt=attempt).model_copy(deep=True)

    async def claim(self, worker_id: str, *, lease_s: float = 60.0, split: str | None = None) -> Claim | None:
        lc.check_lease_s(lease_s, "claim")
        ts = self.clock()
        with self._lock:
            for rollout in self._rollouts.values():
                if rollout.status is RolloutStatus.QUEUED and (split is None or rollout.split == split):
                    index = len(self._rollout_attempts.get(rollout.rollout_id, []))
                    new_rollout, attempt = lc.start_attempt(rollout, index, worker_id, ts + lease_s, ts)
                    self._rollouts[rollout.rollout_id] = new_rollout
                    self._add_attempt(attempt)
                    return Claim(rollout=new_rollout, attempt=attempt).model_copy(deep=True)
        return None

    async def heartbeat(self, attempt_id: str, *, lease_s: float = 60.0) -> Attempt:
        with self._lock:
            attempt = lc.extend_lease(self._attempt(attempt_id), lease_s, self.clock())
            self._attempts[attempt_id] = attempt
            return attempt.model_copy()

    async def finish_attempt(self, attempt_id: str, status: AttemptStatus, error: str | None = None) -> Attempt:
        with self._lock:
            attempt = self._end(attempt_id, AttemptStatus(status), error, self.clock()).model_copy()
        self.attempt_ends.bump()
        return attempt

    async def expire_leases(self) -> list[Attempt]:
        ts = self.clock()
        with self._lock:
            expired = [a.attempt_id for a in self._attempts.values() if lc.lease_expired(a, ts)]
            ended = [self._end(a, AttemptStatus.TIMED_OUT, lc.LEASE_EXPIRED, ts).model_copy() for a in expired]
        self.attempt_ends.bump(len(ended))
        return ended

    async def cancel_rollout(self, rollout_id: str) -> Rollout:
        with self._lock:
            rollout = lc.cancel(self._rollout(rollout_id), self.clock())
            self._rollouts[rollout_id] = rollout
        self.attempt_ends.bump()
        return rollout.model_copy(deep=True)

    async def get_attempt(self, attempt_id: str) -> Attempt:
        with self._lock:
            return self._attempt(attempt_id).model_copy()

    # -- calls and rewards ---------------------------------------------------------------------------------------
    async def attempt_by_token(self, token: str) -> Attempt | None:
        with self._lock:
            attempt_id = self._tokens.get(token)
            return None if attempt_id is None else self._attempts[attempt_id].model_copy()

    async def record_calls(self, calls: list[Call]) -> None:
        with self._lock:
            for call in calls:  # validate the whole batch before changing anything
                lc.check_owner("record_calls", call.attempt_id, call.rollout_id, self._owner(call.attempt_id))
            plain, resent = lc.split_resent(calls)
            for call in plain:
                if call.call_id not in self._calls:
                    self._calls[call.call_id] = _copy_call(call)
                    self._attempt_calls.setdefault(call.attempt_id, []).append(call.call_id)
            for call in resent:  # replaces the stored call of its id, keeping its seq
                stored = self._calls.get(call.call_id)
                copy = _copy_call(call)
                if stored is None:
                    self._attempt_calls.setdefault(call.attempt_id, []).append(call.call_id)
                else:
                    copy.seq = stored.seq
                self._calls[call.call_id] = copy

    async def record_rewards(self, rewards: list[Reward]) -> None:
        with self._lock:
            for reward in rewards:
                lc.check_owner("record_rewards", reward.attempt_id, reward.rollout_id, self._owner(reward.attempt_id))
            for reward in rewards:
                key = (reward.name, reward.call_id or "")
                self._rewards.setdefault(reward.attempt_id, {})[key] = reward.model_copy()

    # -- reading -------------------------------------------------------------------------------------------------
    async def get_rollout(self, rollout_id: str) -> RolloutDetail:
        with self._lock:
            return self._detail(rollout_id)

    async def list_rollouts(
        self, *, status: RolloutStatus | None = None, limit: int = 100, after: str | None = None
    ) -> tuple[list[Rollout], str | None]:
        lc.check_limit(limit, "list_rollouts")
        start = lc.decode_cursor(after)
        want = RolloutStatus(status) if status is not None else None
        page: list[Rollout] = []
        last = 0
        more = False
        with self._lock:
            for rollout_id, seq in self._rollout_seq.items():
                rollout = self._rollouts[rollout_id]
                if seq <= start or (want is not None and rollout.status is not want):
                    continue
                if len(page) == limit:
                    more = True
                    break
                page.append(rollout.model_copy(deep=True))
                last = seq
        return page, (lc.encode_cursor(last) if more else None)

    async def list_rollout_details(
        self, *, limit: int = 100, after: str | None = None
    ) -> tuple[list[RolloutDetail], str | None]:
        page, nxt = await self.list_rollouts(limit=limit, after=after)
        with self._lock:
            return [self._detail(r.rollout_id) for r in page], nxt

    async def list_group_details(
        self, *, split: str | None = None, limit: int = 64, after: str | None = None
    ) -> tuple[list[FinishedGroup], str | None]:
        lc.check_limit(limit, "list_group_details")
        page: list[FinishedGroup] = []
        last, more = 0, False
        with self._lock:
            for pos in range(lc.decode_cursor(after), len(self._group_order)):
                group = self._groups[self._group_order[pos]]
                if split is not None and group.split != split:
                    continue
                if len(page) == limit:
                    more = True
                    break
                rollouts = [self._detail(r) for r in self._group_rollouts.get(group.group_id, [])]
                page.append(FinishedGroup(group.model_copy(deep=True), rollouts))
                last = pos + 1
        return page, (lc.encode_cursor(last) if more else None)

    async def counts(self) -> dict[str, int]:
        with self._lock:
            out = dict.fromkeys(lc.ROLLOUT_STATUSES, 0)
            for rollout in self._rollouts.values():
                out[rollout.status.value] += 1
            out["groups_ready"] = sum(1 for _ in self._ready("train"))
            return out

    # -- training ------------------------------------------------------------------------------------------------
    def _ready(self, split: str) -> list[Group]:
        return [
            g
            for g in self._groups.values()
            if g.split == split
            and g.consumed_step is None
            and lc.group_finished(self._rollouts[r].status for r in self._group_rollouts.get(g.group_id, []))
        ]

    async def finished_groups(self, *, limit: int = 64, split: str = "train") -> list[FinishedGroup]:
        with self._lock:
            return [
                FinishedGroup(
                    g.model_copy(deep=True), [self._detail(r) for r in self._group_rollouts.get(g.group_id, [])]
                )
                for g in self._ready(split)[:limit]
            ]

    async def consume_groups(self, step: int, group_ids: list[str]) -> list[str]:
        with self._lock:
            fresh: list[str] = []
            for gid in group_ids:
                statuses = [self._rollouts[r].status for r in self._group_rollouts.get(gid, [])]
                if lc.check_consumable(gid, self._groups.get(gid), statuses, step) and gid not in fresh:
                    fresh.append(gid)
            for gid in fresh:
                self._groups[gid] = self._groups[gid].model_copy(update={"consumed_step": step})
            return fresh

    async def publish_version(self, version: PolicyVersion) -> None:
        with self._lock:
            self._versions[version.version] = version.model_copy(deep=True)

    async def current_version(self) -> PolicyVersion | None:
        with self._lock:
            if not self._versions:
                return None
            return self._versions[max(self._versions)].model_copy(deep=True)

    async def set_resource(self, resource: Resource) -> None:
        with self._lock:
            self._resources[resource.name] = resource.model_copy(deep=True)

    async def get_resources(self) -> list[Resource]:
        with self._lock:
            return [self._resources[k].model_copy(deep=True) for k in sorted(self._resources)]

    async def set_meta(self, key: str, value: Any) -> None:
        data = _dump(value, key)
        with self._lock:
            self._meta[key] = data

    async def get_meta(self, key: str) -> Any | None:
        with self._lock:
            data = self._meta.get(key)
        return None if data is None else orjson.loads(data)

    async def close(self) -> None:
        self._closed = True


def _dump(value: Any, key: str) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError as exc:
        raise ConfigError(f"meta {key!r}: value is not JSON-serialisable: {exc}") from exc


def _copy_call(call: Call) -> Call:
    """A deep copy of a call, fast for its long id lists (``model_copy(deep=True)`` walks them element by element)."""
    return call.model_copy(
        update={
            "request": _copy_json(call.request),
            "response": _copy_json(call.response),
            "prompt_ids": list(call.prompt_ids),
            "completion_ids": list(call.completion_ids),
            "logprobs": list(call.logprobs),
            "usage": dict(call.usage),
            "checks": _copy_json(call.checks),
        }
    )


def _copy_json(task: Task) -> Task:
    """A deep copy of a JSON object (and a check that it is one)."""
    try:
        out: Task = orjson.loads(orjson.dumps(task))
    except TypeError as exc:
        raise ConfigError(f"task is not JSON-serialisable: {exc}") from exc
    return out
