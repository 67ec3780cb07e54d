"""The data model: tasks, groups, rollouts, attempts, calls, rewards, policy versions and resources.

The words are those of the contract (docs/concepts.md). Lifecycles are data: ``ROLLOUT_TRANSITIONS`` and
``ATTEMPT_TRANSITIONS`` list every legal move, and ``check_rollout_transition`` / ``check_attempt_transition`` are
the one place that enforces them (the store calls them on every change).

Rollout lifecycle::

    queued ──claim──▶ running ──attempt succeeded──▶ succeeded
       ▲                 │ attempt failed / timed out / released
       └──(attempts < max_attempts)──┘     └──(attempts == max_attempts)──▶ failed
    queued ──cancel──▶ cancelled

Attempt lifecycle::

    running ──▶ succeeded | failed | timed_out | released
"""

from __future__ import annotations

import enum
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from lightning_sdk.errors import InvalidTransitionError

__all__ = [
    "ATTEMPT_TRANSITIONS",
    "ROLLOUT_TRANSITIONS",
    "SPLIT_REASONS",
    "TERMINAL_ATTEMPT",
    "TERMINAL_ROLLOUT",
    "Attempt",
    "AttemptStatus",
    "Call",
    "Claim",
    "FinishedGroup",
    "Group",
    "PolicyVersion",
    "Resource",
    "Reward",
    "Rollout",
    "RolloutDetail",
    "RolloutStatus",
    "SplitReason",
    "Task",
    "TokenSource",
    "check_attempt_transition",
    "check_rollout_transition",
    "new_id",
    "now",
]

Task = dict[str, Any]
"""One input for the agent: a JSON object from a dataset."""

TokenSource = Literal["engine", "rendered", "retokenized", "text_only", "external"]
"""Where a call's token ids come from.

- ``engine``: prompt and completion ids are exactly what the engine consumed and sampled (token-in/token-out, or an
  engine that returns ids such as vLLM ``return_token_ids``).
- ``rendered``: the proxy rendered the prompt ids itself; completion ids came from the engine.
- ``retokenized``: the engine returned text only; prompt rendered and reply encoded by the proxy
  (trained only on opt-in).
- ``text_only``: the engine returned text only and nothing rebuilt the ids: recorded with empty ids and
  ``checks["missing_token_ids"]``, never trained (counted as such in the fidelity report).
- ``external``: a model that is not the policy (judge, teacher, hosted provider): text and usage only, never trained.
"""


SplitReason = Literal["compaction", "history_edit", "template_rewrite", "branch", "tools_changed"]
"""Why a trajectory starts a new segment instead of extending the previous call (docs/records.md): the agent
compacted or edited its history, the chat template rewrote earlier turns, a call branched off an earlier state, or
the tool list changed."""

SPLIT_REASONS: tuple[SplitReason, ...] = get_args(SplitReason)


def new_id(prefix: str) -> str:
    """A new random id such as ``ro-3f9c...``."""
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def now() -> float:
    """Wall-clock seconds since the epoch (all timestamps in the store use this)."""
    return time.time()


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False)


class RolloutStatus(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class AttemptStatus(enum.StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    RELEASED = "released"  # handed back by a worker shutting down; does not count against max_attempts


TERMINAL_ROLLOUT = frozenset({RolloutStatus.SUCCEEDED, RolloutStatus.FAILED, RolloutStatus.CANCELLED})
TERMINAL_ATTEMPT = frozenset(
    {AttemptStatus.SUCCEEDED, AttemptStatus.FAILED, AttemptStatus.TIMED_OUT, AttemptStatus.RELEASED}
)

ROLLOUT_TRANSITIONS: dict[RolloutStatus, frozenset[RolloutStatus]] = {
    RolloutStatus.QUEUED: frozenset({RolloutStatus.RUNNING, RolloutStatus.CANCELLED}),
    RolloutStatus.RUNNING: frozenset({RolloutStatus.SUCCEEDED, RolloutStatus.FAILED, RolloutStatus.QUEUED}),
    RolloutStatus.SUCCEEDED: frozenset(),
    RolloutStatus.FAILED: frozenset(),
    RolloutStatus.CANCELLED: frozenset(),
}

ATTEMPT_TRANSITIONS: dict[AttemptStatus, frozenset[AttemptStatus]] = {
    AttemptStatus.RUNNING: frozenset(TERMINAL_ATTEMPT),
    AttemptStatus.SUCCEEDED: frozenset(),
    AttemptStatus.FAILED: frozenset(),
    AttemptStatus.TIMED_OUT: frozenset(),
    AttemptStatus.RELEASED: frozenset(),
}


def check_rollout_transition(rollout_id: str, old: RolloutStatus, new: RolloutStatus) -> None:
    """Raise ``InvalidTransitionError`` unless ``old -> new`` is in ``ROLLOUT_TRANSITIONS``."""
    if new not in ROLLOUT_TRANSITIONS[old]:
        allowed = sorted(s.value for s in ROLLOUT_TRANSITIONS[old]) or ["none (terminal)"]
        raise InvalidTransitionError(
            f"rollout {rollout_id}: cannot move from {old.value!r} to {new.value!r}; allowed: {', '.join(allowed)}"
        )


def check_attempt_transition(attempt_id: str, old: AttemptStatus, new: AttemptStatus) -> None:
    """Raise ``InvalidTransitionError`` unless ``old -> new`` is in ``ATTEMPT_TRANSITIONS``."""
    if new not in ATTEMPT_TRANSITIONS[old]:
        allowed = sorted(s.value for s in ATTEMPT_TRANSITIONS[old]) or ["none (terminal)"]
        raise InvalidTransitionError(
            f"attempt {attempt_id}: cannot move from {old.value!r} to {new.value!r}; allowed: {', '.join(allowed)}"
        )


class Group(_Model):
    """The n rollouts of one task that share a baseline."""

    group_id: str
    task: Task
    n: int
    split: str = "train"  # "train" groups are trained; any other split (e.g. "eval") is never consumed by training
    created_at: float = Field(default_factory=now)
    consumed_step: int | None = None  # the training step that consumed this group (None = not yet)


class Rollout(_Model):
    """One run of the agent on one task: 1..max_attempts attempts, at most one succeeds."""

    rollout_id: str
    group_id: str
    task: Task
    split: str = "train"
    status: RolloutStatus = RolloutStatus.QUEUED
    max_attempts: int = 1
    attempts_used: int = 0  # attempts that counted against max_attempts (released ones do not)
    created_at: float = Field(default_factory=now)
    updated_at: float = Field(default_factory=now)


class Attempt(_Model):
    """One try of a rollout. Owns the bearer token that authorises its LLM calls."""

    attempt_id: str
    rollout_id: str
    index: int  # 0-based position among the rollout's attempts
    token: str
    status: AttemptStatus = AttemptStatus.RUNNING
    worker_id: str | None = None
    error: str | None = None
    lease_expires_at: float | None = None  # None = no lease (a session opened by hand)
    started_at: float = Field(default_factory=now)
    ended_at: float | None = None


class Claim(_Model):
    """What a worker gets when it claims work: the attempt and what it needs to run it."""

    rollout: Rollout
    attempt: Attempt


class Call(_Model):
    """One LLM request/response through the proxy, with the exact token ids the engine consumed and sampled.

    ``prompt_ids`` is the exact context the engine was given, ``completion_ids`` exactly what it sampled, and
    ``logprobs`` (same length as ``completion_ids``) the engine's log-probabilities of those tokens. For calls that
    are not the policy's (``token_source == "external"``) the id lists are empty and ``usage`` carries counts.
    """

    call_id: str
    attempt_id: str
    rollout_id: str
    seq: int = 0  # order of the call within its attempt (assigned by the proxy)
    model: str
    is_policy: bool = True
    token_source: TokenSource = "engine"
    request: dict[str, Any] = Field(default_factory=dict)  # messages, tools and sampling params as sent by the agent
    response: dict[str, Any] = Field(default_factory=dict)  # the OpenAI-shaped response returned to the agent
    prompt_ids: list[int] = Field(default_factory=list)
    completion_ids: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    policy_version: int | None = None
    finish_reason: str | None = None
    usage: dict[str, int] = Field(default_factory=dict)
    checks: dict[str, Any] = Field(default_factory=dict)  # fidelity checks done (e.g. retokenization round trip)
    started_at: float = Field(default_factory=now)
    ended_at: float | None = None
    error: str | None = None
    idempotency_key: str | None = None
    """The agent's ``Idempotency-Key`` for this call (None when it sent none). The proxy derives the call's id from
    the attempt and the key (``resent_call_id``), so a call the agent re-sent (a retry of a call whose answer never
    came: a proxy killed after it committed the call) has the id of the first; a store then keeps one call per id:
    the re-sent call's record replaces the first (the agent used the second answer), keeping the first's ``seq``."""

    @classmethod
    def from_checked(cls, **fields: Any) -> Call:
        """A ``Call`` from values the caller has already checked against the field types (every field given):
        no validation and no copies of the id and log-prob lists. The proxy's hot path uses it for answers whose
        ids and log-probs ``proxy/_shapes.py`` checked (validating them again cost ~3 us a call); anything else
        goes through ``Call(...)``. Equal to ``Call(**fields)`` for such values (tested)."""
        if list(fields) != _CALL_ORDER:  # the fields in declaration order: the order model_dump_json writes them
            if fields.keys() != _CALL_FIELDS:
                raise TypeError(
                    f"Call.from_checked needs every field; missing or unknown: {fields.keys() ^ _CALL_FIELDS}"
                )
            fields = {name: fields[name] for name in _CALL_ORDER}
        call = cls.__new__(cls)
        object.__setattr__(call, "__dict__", fields)
        object.__setattr__(call, "__pydantic_fields_set__", set(_CALL_FIELDS))
        object.__setattr__(call, "__pydantic_extra__", None)
        object.__setattr__(call, "__pydantic_private__", None)
        return call


_CALL_FIELDS = Call.model_fields.keys()
_CALL_ORDER = list(_CALL_FIELDS)


class Reward(_Model):
    """A scalar reward for an attempt (final when ``call_id`` is None, otherwise for that call)."""

    rollout_id: str
    attempt_id: str
    value: float
    name: str = "reward"
    call_id: str | None = None
    created_at: float = Field(default_factory=now)


class PolicyVersion(_Model):
    """A weight publication by the trainer. Every call records the version that served it."""

    version: int
    step: int | None = None
    created_at: float = Field(default_factory=now)
    meta: dict[str, Any] = Field(default_factory=dict)


class Resource(_Model):
    """An engine endpoint and the model name it serves (the policy or an external model)."""

    name: str  # the model name agents use (e.g. "policy")
    base_url: str | None = None
    kind: str = "openai"  # embedded | sglang | vllm | openai | litellm
    is_policy: bool = True
    meta: dict[str, Any] = Field(default_factory=dict)


class AttemptDetail(_Model):
    attempt: Attempt
    calls: list[Call] = Field(default_factory=list)
    rewards: list[Reward] = Field(default_factory=list)


class RolloutDetail(_Model):
    """A rollout with its attempts, their calls and rewards (what ``GET /lightning/v1/rollouts/{id}`` serves)."""

    rollout: Rollout
    attempts: list[AttemptDetail] = Field(default_factory=list)

    def succeeded_attempt(self) -> AttemptDetail | None:
        for a in self.attempts:
            if a.attempt.status is AttemptStatus.SUCCEEDED:
                return a
        return None


@dataclass(slots=True)
class FinishedGroup:
    """A group with its rollouts (each with its attempts, calls and rewards): what records are built from.

    ``Store.finished_groups`` answers the groups whose rollouts are all terminal and that no training step has
    consumed yet; ``lightning_sdk.store.load_groups`` every group of a split, for export."""

    group: Group
    rollouts: list[RolloutDetail]
