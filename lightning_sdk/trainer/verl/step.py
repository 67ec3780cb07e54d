"""One verl training step over a ``DataProto``, independent of where the ranks live (in-process or Ray actors).

The step, top to bottom (what verl's ``RayPPOTrainer.fit`` does after rollout, minus rollout and advantages,
which our records already carry):

1. ``old_log_probs``: recomputed by the actor (``tis``, ``none``) or taken from the engine (``bypass``).
2. ``tis``: token-level truncated importance weights from verl's ``rollout_corr_helper``
   (``min(exp(old - rollout), threshold)``), stored as ``rollout_is_weights`` for the loss.
3. ``ref_log_prob`` when the KL loss is on.
4. ``update_actor`` on every rank with its shard of the rows (verl's PPO loss, ``workers/utils/losses.ppo_loss``).

``Ranks`` abstracts the calls so ``LocalRanks`` (one in-process ``VerlRank``) and the Ray actors share this code.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

__all__ = ["Ranks", "run_step", "shard_tensordicts"]

logger = logging.getLogger(__name__)


class Ranks(Protocol):
    """Fan a method out to every rank with one argument each, and gather the results in rank order."""

    @property
    def world_size(self) -> int: ...

    def call(self, method: str, args: Sequence[Any]) -> list[Any]: ...


def _pad_rows(data: Any, world_size: int) -> tuple[Any, int]:
    """Pad the batch to a multiple of ``world_size`` with copies whose ``response_mask`` is 0 (they train nothing)."""
    from verl.protocol import pad_dataproto_to_divisor

    padded, pad = pad_dataproto_to_divisor(data, world_size)
    if pad:
        padded.batch["response_mask"][-pad:] = 0
        padded.batch["advantages"][-pad:] = 0.0
    return padded, pad


def shard_tensordicts(data: Any, world_size: int, **meta: Any) -> list[Any]:
    """Split a (padded) ``DataProto`` into one no-padding TensorDict per rank, with ``meta`` as non-tensor data."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    shards = data.chunk(world_size) if world_size > 1 else [data]
    out = []
    for shard in shards:
        td = left_right_2_no_padding(shard.to_tensordict())
        if meta:
            tu.assign_non_tensor(td, **meta)
        out.append(td)
    return out


def _gather(parts: list[torch.Tensor]) -> torch.Tensor:
    width = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts], dim=0)


def run_step(
    ranks: Ranks,
    data: Any,
    config: Any,
    *,
    on_phase: Callable[[str], None] | None = None,
) -> dict[str, float]:
    """Run one verl update over ``data`` (a ``DataProto`` from ``records_to_dataproto``); returns verl's metrics
    (rank 0) plus our own (``rollout_corr/*`` from verl's helper, ``step/rows``)."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

    mode = str(config.lightning.rollout_correction)
    temperature = float(config.actor_rollout_ref.rollout.temperature)
    world = ranks.world_size
    n_rows = len(data)
    data, _ = _pad_rows(data, world)
    data.meta_info["temperature"] = temperature
    metrics: dict[str, float] = {"step/rows": float(n_rows)}

    def phase(name: str) -> None:
        if on_phase is not None:
            on_phase(name)

    if mode == "bypass":
        data.batch["old_log_probs"] = data.batch["rollout_log_probs"].clone()
    else:
        phase("old_log_prob")
        parts = ranks.call("compute_log_prob", shard_tensordicts(data, world))
        width = data.batch["responses"].shape[1]
        data.batch["old_log_probs"] = _gather(parts)[:, :width]
    if mode == "tis":
        data, corr = compute_rollout_correction_and_add_to_batch(data, config.algorithm.rollout_correction)
        metrics.update({k: float(v) for k, v in corr.items() if isinstance(v, int | float | torch.Tensor)})
    if bool(config.actor_rollout_ref.actor.use_kl_loss):
        phase("ref_log_prob")
        parts = ranks.call("compute_ref_log_prob", shard_tensordicts(data, world))
        data.batch["ref_log_prob"] = _gather(parts)[:, : data.batch["responses"].shape[1]]

    actor = config.actor_rollout_ref.actor
    rows_per_rank = len(data) // world
    mini = max(1, rows_per_rank // max(1, int(config.lightning.mini_batches_per_step))) * world
    meta = {
        "calculate_entropy": bool(actor.calculate_entropy) or float(actor.entropy_coeff) != 0.0,
        "distillation_use_topk": False,
        "distillation_only": False,
        "global_batch_size": mini,
        "mini_batch_size": mini,
        "epochs": int(actor.ppo_epochs),
        "seed": int(actor.data_loader_seed),
        "dataloader_kwargs": {"shuffle": bool(actor.shuffle)},
        "compute_loss": True,
    }
    phase("update_actor")
    results = ranks.call("update_actor", shard_tensordicts(data, world, **meta))
    metrics.update(results[0])
    return metrics
