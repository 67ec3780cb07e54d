"""Read every group of a split out of a store, for export: the records loader.

``Store.finished_groups`` answers what training has not consumed yet; an export wants everything, consumed or not,
with rollouts still running (only succeeded attempts are exported, so those simply give fewer rows). The groups come
a page at a time in creation order, each with its rollouts' attempts, calls and rewards
(``Store.list_group_details``: one read per page, one HTTP request per page over ``HTTPStore``), so a caller that
handles a page before asking for the next holds one page in memory whatever the size of the store.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from lightning_sdk.store.base import Store
from lightning_sdk.types import FinishedGroup

__all__ = ["iter_group_pages", "load_groups"]


async def iter_group_pages(
    store: Store, *, split: str | None = "train", page: int = 64
) -> AsyncIterator[list[FinishedGroup]]:
    """Pages of at most ``page`` groups (of ``split``; None = all) with every rollout, in creation order."""
    after: str | None = None
    while True:
        groups, after = await store.list_group_details(split=split, limit=page, after=after)
        if groups:
            yield groups
        if after is None:
            return


async def load_groups(store: Store, *, split: str | None = "train", page: int = 64) -> list[FinishedGroup]:
    """Every group in ``store`` (of ``split``; None = all) with its rollouts, in creation order (all in memory:
    ``iter_group_pages`` streams them)."""
    return [g async for groups in iter_group_pages(store, split=split, page=page) for g in groups]
