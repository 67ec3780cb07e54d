"""lightning_sdk: train the LLM agents you already have with reinforcement learning.

The public surface (the contract in docs/concepts.md)::

    import lightning_sdk as ls

    @ls.rollout
    def agent(task: dict, llm: ls.LLM) -> float | None: ...

Heavy dependencies (torch, transformers engines) are imported only by the parts that need them.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from lightning_sdk.agent import LLM, CommandAgent, WorkerPool, current_attempt, emit_reward, rollout, run_tasks
from lightning_sdk.errors import (
    AttemptNotRunningError,
    AuthError,
    ConfigError,
    EngineError,
    InvalidTransitionError,
    LightningSDKError,
    NotFoundError,
    RecordError,
    StoreError,
    StoreUnavailableError,
    TokenizationError,
    TrainerError,
    UpstreamError,
)
from lightning_sdk.store import Store, open_store
from lightning_sdk.types import (
    Attempt,
    AttemptStatus,
    Call,
    Group,
    PolicyVersion,
    Resource,
    Reward,
    Rollout,
    RolloutStatus,
    Task,
)

try:
    __version__ = version("lightning-rl-sdk")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0"

__all__ = [
    "LLM",
    "Attempt",
    "AttemptNotRunningError",
    "AttemptStatus",
    "AuthError",
    "Call",
    "CommandAgent",
    "ConfigError",
    "EngineError",
    "Group",
    "InvalidTransitionError",
    "LightningSDKError",
    "NotFoundError",
    "PolicyVersion",
    "RecordError",
    "Resource",
    "Reward",
    "Rollout",
    "RolloutStatus",
    "Store",
    "StoreError",
    "StoreUnavailableError",
    "Task",
    "TokenizationError",
    "TrainerError",
    "UpstreamError",
    "WorkerPool",
    "__version__",
    "current_attempt",
    "emit_reward",
    "open_store",
    "rollout",
    "run_tasks",
]
