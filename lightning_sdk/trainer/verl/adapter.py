"""``VerlLearner``: the verl backend behind the learner protocol (``step(records)``, ``weights``, ``state_dict``),
so the trainer daemon swaps one for the other (``backend: verl``) without a second training loop.

Each backend builds its own batch from the records: the embedded ``Learner`` pads them (``train_batch``), verl's
side lays them out as a ``DataProto`` (``records_to_dataproto``: left-padded prompts, right-padded responses, the
group id as ``uid`` and the reward on the last trained token as ``token_level_scores``, so verl's own estimators
can read the batch). After each step the daemon publishes ``learner.weights()`` (the full weights, from rank 0).
Checkpoints hold the weights and the step count; verl's optimizer state is not in them (a resumed run restarts
AdamW's moments), which ``load_state_dict`` says in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedTokenizerBase

from lightning_sdk.engines.serving import ServingEngine
from lightning_sdk.errors import TrainerError
from lightning_sdk.records.record import Record
from lightning_sdk.trainer.parts import LearnerLike, Parts
from lightning_sdk.trainer.verl.backend import VerlBackend

if TYPE_CHECKING:
    from lightning_sdk.trainer.config import VerlSettings

__all__ = ["VerlLearner", "verl_parts"]

logger = logging.getLogger(__name__)


class VerlLearner(LearnerLike):
    """The learner protocol (``step``, ``weights``, ``state_dict``, ``load_state_dict``, ``steps``) over a
    ``VerlBackend``."""

    def __init__(self, backend: VerlBackend) -> None:
        self.backend = backend
        self.steps = 0

    def step(self, records: Sequence[Record]) -> dict[str, float]:
        trained = [r for r in records if r.segment.n_trained > 0]
        if not trained:
            raise TrainerError("the batch has no trained tokens")
        metrics = self.backend.step(trained)
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


def verl_parts(
    launch: VerlSettings,
    run_dir: Path,
    model_dir: Path,
    engine: ServingEngine,
    tokenizer: PreTrainedTokenizerBase,
    *,
    remote: bool,
) -> Parts:
    """The parts of a run with ``backend = "verl"`` (``[verl]``): verl's FSDP ranks (in this process, or Ray
    actors) as the learner; a remote engine loads each version from a checkpoint the ranks write under
    ``RUN_DIR/weights``, the embedded one takes the gathered state dict."""
    pad = tokenizer.pad_token_id
    config = launch.verl_config(str(model_dir))
    backend = VerlBackend(
        config,
        ray_address=launch.ray_address,
        ray_num_cpus=launch.ray_num_cpus,
        use_ray=launch.use_ray,
        publish_dir=run_dir / "weights",
        pad_id=int(pad) if pad is not None else 0,
    )
    learner = VerlLearner(backend)

    def save(out: Path) -> None:
        backend.ranks.call_all("save_hf", str(out))
        tokenizer.save_pretrained(str(out))

    return Parts(
        engine=engine,
        learner=learner,
        weights=backend.save_weights if remote else learner.weights,
        save_model=save,
        model=None,
        closers=[backend.shutdown],
    )
