"""``VerlLearner``: the verl backend behind the embedded ``Learner``'s interface, so the trainer daemon can swap
one for the other (``backend: verl``) without a second training loop.

The daemon hands the learner a padded ``TrainBatch`` (right padding, per-token ``loss_mask``/``logprobs``/
``advantages`` already weighted per row) and publishes ``learner.weights()`` to its engine after each step; this
class turns the batch back into rows, runs one verl update and reads the full weights back from rank 0.
Checkpoints hold the weights and the step count; verl's optimizer state is not in them (a resumed run restarts
AdamW's moments), which ``load_state_dict`` says in the log.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from lightning_sdk.errors import TrainerError
from lightning_sdk.trainer.learner import TrainBatch
from lightning_sdk.trainer.verl.backend import VerlBackend
from lightning_sdk.trainer.verl.batch import TrainRow

__all__ = ["VerlLearner", "rows_from_train_batch"]

logger = logging.getLogger(__name__)


def rows_from_train_batch(batch: TrainBatch) -> list[TrainRow]:
    """The rows of a right-padded ``TrainBatch`` (weights already folded into the advantages)."""
    rows: list[TrainRow] = []
    lengths = batch.attention_mask.sum(dim=1).tolist()
    for i, n in enumerate(int(x) for x in lengths):
        mask = [int(m) for m in batch.loss_mask[i, :n].tolist()]
        if not any(mask):
            continue
        rows.append(
            TrainRow(
                input_ids=[int(t) for t in batch.input_ids[i, :n].tolist()],
                loss_mask=mask,
                logprobs=[float(x) for x in batch.logprobs[i, :n].tolist()],
                advantages=[float(x) for x in batch.advantages[i, :n].tolist()],
                reward=0.0,
                group="",  # advantages are already computed; the update does not group rows
                segment=i,
            )
        )
    return rows


class VerlLearner:
    """Duck-types ``lightning_sdk.trainer.learner.Learner`` (``step``, ``weights``, ``state_dict``,
    ``load_state_dict``, ``steps``) over a ``VerlBackend``."""

    def __init__(self, backend: VerlBackend) -> None:
        self.backend = backend
        self.steps = 0

    def step(self, batch: TrainBatch) -> dict[str, float]:
        rows = rows_from_train_batch(batch)
        if not rows:
            raise TrainerError("the batch has no trained tokens")
        metrics = self.backend.step(rows)
        self.steps += 1
        return metrics

    def weights(self) -> dict[str, torch.Tensor]:
        """The full current weights on CPU (what the engine swaps in)."""
        return self.backend.state_dict()

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.weights(), "steps": self.steps, "policy_version": self.backend.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the step count and version; the weights must come back through verl's own checkpoint (the
        model directory the backend starts from), so a resume passes the last published weights as ``model_dir``."""
        self.steps = int(state["steps"])
        self.backend.version = int(state.get("policy_version", self.steps))
        logger.warning("verl backend resumed at step %d: optimizer moments start fresh", self.steps)
