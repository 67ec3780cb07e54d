"""``reap_leases``: the background task that times out attempts whose lease has run out."""

from __future__ import annotations

import asyncio
import logging

from lightning_sdk.errors import ConfigError, StoreError
from lightning_sdk.store.base import Store

__all__ = ["reap_leases"]

logger = logging.getLogger(__name__)


async def reap_leases(store: Store, *, interval_s: float = 1.0) -> None:
    """Call ``store.expire_leases()`` every ``interval_s`` seconds until cancelled (run it as a task in the
    process that owns the store). A failing store is logged and tried again at the next tick."""
    if interval_s <= 0:
        raise ConfigError(f"reap_leases: interval_s must be > 0, got {interval_s}")
    while True:
        try:
            expired = await store.expire_leases()
        except StoreError as exc:
            logger.warning("lease reaper: %s", exc)
        else:
            for attempt in expired:
                logger.info("attempt %s of rollout %s timed out (lease expired, worker %s)", attempt.attempt_id,
                            attempt.rollout_id, attempt.worker_id)  # fmt: skip
        await asyncio.sleep(interval_s)
