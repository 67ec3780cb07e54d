"""Records to padded arrays for a trainer (the embedded learner and the verl backend both call this).

``build_batch`` returns numpy arrays (right-padded, shape ``(B, T)`` unless noted)::

    input_ids       int64   token ids, ``pad_id`` after the end
    attention_mask  int64   1 on real tokens
    position_ids    int64   0..len-1 on real tokens, 0 on padding
    loss_mask       float32 1 on trained tokens (sampled by the policy)
    old_logprobs    float32 the engine's log-probabilities of the trained tokens, 0 elsewhere
    advantages      float32 per-token advantage, 0 where the mask is 0
    sample_weight   float32 (B,) the row's share of its rollout (rows of a rollout sum to 1)
    rewards         float32 (B,) the attempt's reward

``to_torch`` turns them into tensors when torch is installed. Nothing here knows the estimator or the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_sdk.errors import RecordError
from lightning_sdk.records.record import Record

__all__ = ["build_batch", "to_torch"]


def build_batch(
    records: Sequence[Record],
    *,
    pad_id: int = 0,
    pad_to_multiple_of: int = 1,
    max_length: int | None = None,
) -> dict[str, npt.NDArray[Any]]:
    """Pad ``records`` into one batch. ``max_length`` refuses (``RecordError``) rows that are longer: cut records
    with ``MergeOptions.max_length`` instead, so truncation is always explicit."""
    if not records:
        raise RecordError("cannot build a batch from no records")
    lengths = np.fromiter((len(r) for r in records), dtype=np.int64, count=len(records))
    longest = int(lengths.max())
    if max_length is not None and longest > max_length:
        raise RecordError(
            f"a record has {longest} tokens, more than max_length={max_length}; truncate with MergeOptions.max_length"
        )
    width = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    b = len(records)
    input_ids = np.full((b, width), pad_id, dtype=np.int64)
    attention = np.zeros((b, width), dtype=np.int64)
    loss_mask = np.zeros((b, width), dtype=np.float32)
    old_logprobs = np.zeros((b, width), dtype=np.float32)
    advantages = np.zeros((b, width), dtype=np.float32)
    for i, rec in enumerate(records):
        n = int(lengths[i])
        input_ids[i, :n] = rec.input_ids
        attention[i, :n] = 1
        loss_mask[i, :n] = rec.loss_mask
        old_logprobs[i, :n] = rec.logprobs
        advantages[i, :n] = rec.advantages
    positions = np.maximum(np.cumsum(attention, axis=1) - 1, 0) * attention
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "position_ids": positions,
        "loss_mask": loss_mask,
        "old_logprobs": old_logprobs,
        "advantages": advantages,
        "sample_weight": np.asarray([r.weight for r in records], dtype=np.float32),
        "rewards": np.asarray([r.reward for r in records], dtype=np.float32),
    }


def to_torch(batch: dict[str, npt.NDArray[Any]], device: str | None = None) -> dict[str, Any]:
    """The same batch as torch tensors (torch is imported here, so the rest of records does not need it)."""
    import torch

    return {k: torch.from_numpy(v).to(device) if device else torch.from_numpy(v) for k, v in batch.items()}
