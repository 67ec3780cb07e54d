"""The public surface is curated: ``lightning_sdk.__all__`` is exactly this list, and every name resolves."""

from __future__ import annotations

import lightning_sdk

EXPECTED = {
    "LLM", "Attempt", "AttemptNotRunningError", "AttemptStatus", "AuthError", "Call", "CommandAgent", "ConfigError",
    "EngineError", "Group", "InvalidTransitionError", "LightningSDKError", "NotFoundError", "PolicyVersion",
    "RecordError", "Resource", "Reward", "Rollout", "RolloutStatus", "Store", "StoreError", "StoreUnavailableError",
    "Task", "TokenizationError", "TrainerError", "UpstreamError", "WorkerPool", "__version__", "current_attempt",
    "emit_reward", "open_store", "rollout", "run_tasks",
}  # fmt: skip


def test_exported_members_are_exactly_the_contract() -> None:
    assert set(lightning_sdk.__all__) == EXPECTED
    for name in lightning_sdk.__all__:
        assert hasattr(lightning_sdk, name), name


def test_every_error_derives_from_the_root() -> None:
    for name in lightning_sdk.__all__:
        obj = getattr(lightning_sdk, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, lightning_sdk.LightningSDKError), name
