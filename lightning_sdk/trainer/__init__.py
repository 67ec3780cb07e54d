"""The trainer: the learner, policy losses, checkpoints, the training config and the verl backend.

- ``Learner`` / ``LearnerConfig`` / ``TrainBatch``: policy gradient with truncated importance sampling on a local
  torch model (PPO-clip acts when ``ppo_epochs`` / ``mini_batches`` make more than one update per step).
- ``get_policy_loss`` / ``register_policy_loss``: losses by name (``ppo_clip`` equals verl's vanilla loss).
- ``Checkpoint``: what a step writes so a killed run resumes with no group trained twice and none lost.
- ``TrainConfig``: ``train.toml`` composed of the components' own configs.
- the training loop (``lightning_sdk.app.loop``) and the jobs that compose these (``lightning-sdk train`` /
  ``daemon``) are in ``lightning_sdk.app``.

See docs/training.md.
"""

from lightning_sdk.trainer.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from lightning_sdk.trainer.config import TrainConfig, load_train_config
from lightning_sdk.trainer.learner import Learner, LearnerConfig, TrainBatch, token_logprobs, train_batch
from lightning_sdk.trainer.losses import LossSettings, get_policy_loss, policy_loss_names, register_policy_loss

__all__ = [
    "Checkpoint",
    "Learner",
    "LearnerConfig",
    "LossSettings",
    "TrainBatch",
    "TrainConfig",
    "get_policy_loss",
    "load_checkpoint",
    "load_train_config",
    "policy_loss_names",
    "register_policy_loss",
    "save_checkpoint",
    "token_logprobs",
    "train_batch",
]
