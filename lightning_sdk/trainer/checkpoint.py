"""Trainer checkpoints: model, optimizer, step, policy version and the groups every step consumed.

Written write-then-rename (``checkpoint.pt.tmp`` then ``os.replace``), so a killed daemon finds either the previous
checkpoint or the new one, never a torn file. Exactly-once training follows from the order of a step: train, write
the checkpoint (which names the step's groups), then mark the groups consumed in the store. A restart re-marks the
last checkpoint's groups (``consume_groups`` is idempotent); a step that crashed before its checkpoint left its
groups unconsumed, and the resumed run trains them once.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_sdk.errors import TrainerError

__all__ = ["Checkpoint", "load_checkpoint", "save_checkpoint"]

logger = logging.getLogger(__name__)

CHECKPOINT_NAME = "checkpoint.pt"


@dataclass
class Checkpoint:
    step: int
    version: int
    learner: dict[str, Any]
    consumed: dict[int, dict[str, list[str]]] = field(
        default_factory=dict
    )  # step -> {"trained": [...], "dropped": [...], "screened": [...] (only when any)}
    next_task: int = 0  # index of the next train task to enqueue
    extra: dict[str, Any] = field(default_factory=dict)

    def groups_of(self, step: int) -> list[str]:
        entry = self.consumed.get(step, {})
        return [gid for key in ("trained", "dropped", "screened") for gid in entry.get(key, [])]


def save_checkpoint(run_dir: str | Path, ckpt: Checkpoint) -> Path:
    """Atomically write ``ckpt`` to ``run_dir/checkpoint.pt``."""
    path = Path(run_dir) / CHECKPOINT_NAME
    tmp = path.with_suffix(".pt.tmp")
    payload = {
        "step": ckpt.step,
        "version": ckpt.version,
        "learner": ckpt.learner,
        "consumed": ckpt.consumed,
        "next_task": ckpt.next_task,
        "extra": ckpt.extra,
    }
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_checkpoint(run_dir: str | Path) -> Checkpoint | None:
    """The checkpoint in ``run_dir``, or None when there is none."""
    path = Path(run_dir) / CHECKPOINT_NAME
    if not path.exists():
        return None
    try:
        data = torch.load(path, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, EOFError) as exc:
        raise TrainerError(f"cannot read the checkpoint {path}: {exc}") from exc
    return Checkpoint(
        step=int(data["step"]),
        version=int(data["version"]),
        learner=data["learner"],
        consumed={int(k): v for k, v in data["consumed"].items()},
        next_task=int(data.get("next_task", 0)),
        extra=dict(data.get("extra", {})),
    )
