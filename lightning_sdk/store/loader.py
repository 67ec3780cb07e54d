"""Read every group of a split out of a store, for export: the records loader.

``Store.finished_groups`` answers what training has not consumed yet; an export wants everything, consumed or not,
with rollouts still running (only succeeded attempts are exported, so those simply give fewer rows). The rollouts
come a page at a time with their attempts, calls and rewards (``Store.list_rollout_details``: one read per page,
one HTTP request per page over ``HTTPStore``), grouped by group in creation order.
"""

from __future__ import annotations

from lightning_sdk.store.base import Store
from lightning_sdk.types import FinishedGroup, Group, RolloutDetail

__all__ = ["load_groups"]


async def load_groups(store: Store, *, split: str | None = "train", page: int = 500) -> list[FinishedGroup]:
    """Every rollout in ``store`` (of ``split``; None = all), with its attempts, grouped by group in creation order."""
    by_group: dict[str, list[RolloutDetail]] = {}
    after: str | None = None
    while True:
        details, after = await store.list_rollout_details(limit=page, after=after)
        for detail in details:
            if split is None or detail.rollout.split == split:
                by_group.setdefault(detail.rollout.group_id, []).append(detail)
        if after is None:
            break
    out: list[FinishedGroup] = []
    for gid, details in by_group.items():
        first = details[0].rollout
        out.append(FinishedGroup(Group(group_id=gid, task=first.task, n=len(details), split=first.split), details))
    return out
