"""Task and demonstration sources named by the training config: a JSONL file or ``FILE.py:FUNCTION``.

A function source is called with no arguments and must return a list of dicts (the example's generator), so an
example can ship code instead of data files. The references are absolute by now (``TrainConfig`` resolved them when
it was loaded). ``load_tasks`` reads every set a job uses, once, from the ``[data]`` section.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_sdk.errors import ConfigError
from lightning_sdk.trainer.config import DataConfig

__all__ = ["Tasks", "load_rows", "load_tasks"]


@dataclass
class Tasks:
    """The task sets of a job: ``train`` (RL), ``heldout`` (evaluated, never trained on; at most ``eval.n``),
    ``demonstrations`` (the warm start's chats) and ``validation`` (what decides when the warm start stops)."""

    train: list[dict[str, Any]] = field(default_factory=list)
    heldout: list[dict[str, Any]] = field(default_factory=list)
    demonstrations: list[dict[str, Any]] = field(default_factory=list)
    validation: list[dict[str, Any]] = field(default_factory=list)


def load_tasks(
    data: DataConfig,
    *,
    require_train: bool = True,
    heldout_n: int | None = None,
    validation_tail: int | None = None,
) -> Tasks:
    """Every set ``[data]`` names. ``data.train`` must be set when ``require_train``; ``heldout_n`` None: no
    held-out set (evaluation off), else its first ``heldout_n`` tasks; ``validation_tail`` None: no validation set
    (no warm start), else ``data.validation`` when given, or the last ``validation_tail`` train tasks."""
    train = load_rows(data.train, "data.train") if data.train or require_train else []
    demos = load_rows(data.demonstrations, "data.demonstrations") if data.demonstrations else []
    heldout = load_rows(data.heldout, "data.heldout")[:heldout_n] if heldout_n is not None else []
    validation: list[dict[str, Any]] = []
    if validation_tail is not None:
        validation = load_rows(data.validation, "data.validation") if data.validation else train[-validation_tail:]
    return Tasks(train, heldout, demos, validation)


def load_rows(ref: str | None, what: str) -> list[dict[str, Any]]:
    """The rows ``ref`` (an absolute path or ``FILE.py:FUNCTION``) names; ``what`` names the config key in errors."""
    if not ref:
        raise ConfigError(f"{what} is not set in the training config")
    resolved = ref
    if ".py:" in resolved:
        from lightning_sdk.agent import import_path

        path, _, attr = resolved.partition(".py:")
        try:
            module = import_path(Path(path + ".py"))
        except FileNotFoundError:
            raise ConfigError(f"{what}: no file {path}.py") from None
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise ConfigError(f"{what}: {path}.py has no function {attr!r}")
        rows = fn()
    else:
        path_obj = Path(resolved)
        if not path_obj.exists():
            raise ConfigError(f"{what}: no file {path_obj}")
        rows = [json.loads(line) for line in path_obj.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ConfigError(f"{what}: expected a list of JSON objects")
    return rows
