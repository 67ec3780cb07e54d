"""The wire shapes of the store's HTTP API: one pydantic model per request/response body, and the error mapping.

Shared by ``http_server`` (which parses requests and writes responses) and ``http_client`` (the reverse), so both
ends agree by construction. Bodies are JSON written and read with orjson; errors use the OpenAI error shape
``{"error": {"message", "type", "code"}}``.
"""

from __future__ import annotations

from typing import Annotated, Any

import orjson
from pydantic import BaseModel, ConfigDict, Field

from lightning_sdk.errors import LightningSDKError
from lightning_sdk.http_errors import error_fields, exception_for
from lightning_sdk.types import (
    Attempt,
    AttemptStatus,
    Call,
    Claim,
    Group,
    PolicyVersion,
    Resource,
    Reward,
    Rollout,
    RolloutDetail,
    Task,
)

__all__ = [
    "MAX_ENQUEUE_ROLLOUTS",
    "AttemptBody",
    "AttemptsBody",
    "CallsBody",
    "ClaimBody",
    "ClaimRequest",
    "ConsumeBody",
    "ConsumeRequest",
    "CountsBody",
    "EnqueueRequest",
    "ErrorBody",
    "ErrorDetail",
    "FinishRequest",
    "FinishedGroupBody",
    "FinishedGroupsBody",
    "GroupsBody",
    "HeartbeatRequest",
    "MaybeAttemptBody",
    "MetaBody",
    "OkBody",
    "OpenSessionRequest",
    "ResourcesBody",
    "RewardsBody",
    "RolloutBody",
    "RolloutDetailBody",
    "RolloutDetailPageBody",
    "RolloutPageBody",
    "TokenRequest",
    "VersionBody",
    "dump",
    "error_for",
    "error_from",
]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- requests ---------------------------------------------------------------------------------------------------------
MAX_ENQUEUE_ROLLOUTS = 10_000
"""The most rollouts one enqueue request may open (len(tasks) * n): a bigger one blocks the store writer."""


class EnqueueRequest(_Wire):
    tasks: list[Task]
    n: int = 1
    max_attempts: int = 1
    split: str = "train"
    group_ids: list[str] | None = None


class OpenSessionRequest(_Wire):
    task: Task | None = None
    group_id: str | None = None
    split: str = "train"


MAX_LEASE_S = 86_400.0
"""The longest lease a claim or heartbeat may ask for (one day): past it, 400 (a lease that never expires would keep
a dead worker's attempt running for ever)."""
LeaseSeconds = Annotated[float, Field(gt=0, le=MAX_LEASE_S, allow_inf_nan=False)]


class ClaimRequest(_Wire):
    worker_id: str
    lease_s: LeaseSeconds = 60.0
    split: str | None = None


class HeartbeatRequest(_Wire):
    lease_s: LeaseSeconds = 60.0


class FinishRequest(_Wire):
    status: AttemptStatus
    error: str | None = None


class TokenRequest(_Wire):
    token: str


class CallsBody(_Wire):
    calls: list[Call]


class RewardsBody(_Wire):
    rewards: list[Reward]


class ConsumeRequest(_Wire):
    step: int
    group_ids: list[str]


class MetaBody(_Wire):
    value: Any = None


# -- responses --------------------------------------------------------------------------------------------------------
class GroupsBody(_Wire):
    groups: list[Group]


class ClaimBody(_Wire):
    claim: Claim | None


class AttemptBody(_Wire):
    attempt: Attempt


class MaybeAttemptBody(_Wire):
    attempt: Attempt | None


class AttemptsBody(_Wire):
    attempts: list[Attempt]


class RolloutBody(_Wire):
    rollout: Rollout


class RolloutDetailBody(_Wire):
    detail: RolloutDetail


class RolloutDetailPageBody(_Wire):
    details: list[RolloutDetail]
    next: str | None


class RolloutPageBody(_Wire):
    rollouts: list[Rollout]
    next: str | None


class CountsBody(_Wire):
    counts: dict[str, int]


class FinishedGroupBody(_Wire):
    group: Group
    rollouts: list[RolloutDetail]


class FinishedGroupsBody(_Wire):
    groups: list[FinishedGroupBody]


class GroupDetailPageBody(_Wire):
    groups: list[FinishedGroupBody]
    next: str | None


class ConsumeBody(_Wire):
    consumed: list[str]


class VersionBody(_Wire):
    version: PolicyVersion | None


class ResourcesBody(_Wire):
    resources: list[Resource]


class OkBody(_Wire):
    ok: bool = True


class ErrorDetail(_Wire):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(_Wire):
    error: ErrorDetail = Field(...)


def dump(model: BaseModel) -> bytes:
    """A wire model as compact JSON bytes (floats written so that they read back exactly)."""
    return orjson.dumps(model.model_dump())


# -- errors -----------------------------------------------------------------------------------------------------------
# One table for every route: ``lightning_sdk.http_errors.ERROR_TABLE`` (the proxy answers alike).


def error_for(exc: LightningSDKError) -> tuple[int, ErrorBody]:
    """The HTTP status and body that report ``exc``."""
    status, kind, code = error_fields(exc)
    return status, ErrorBody(error=ErrorDetail(message=str(exc), type=kind, code=code))


def error_from(status: int, content: bytes) -> LightningSDKError:
    """The exception a client raises for an error response (by ``code`` when it is ours, else by status)."""
    try:
        detail = ErrorBody.model_validate(orjson.loads(content)).error
        message, code = detail.message, detail.code
    except (orjson.JSONDecodeError, ValueError):
        message, code = content[:500].decode(errors="replace") or f"HTTP {status}", None
    return exception_for(status, code, message)
