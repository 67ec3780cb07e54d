"""Task and demonstration sources named by the training config: a JSONL file or ``FILE.py:FUNCTION``.

A function source is called with no arguments and must return a list of dicts (the example's generator), so an
example can ship code instead of data files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning_sdk.errors import ConfigError
from lightning_sdk.trainer.config import TrainConfig

__all__ = ["load_rows"]


def load_rows(config: TrainConfig, ref: str | None, what: str) -> list[dict[str, Any]]:
    """The rows ``ref`` names (see the module docstring); ``what`` names the config key in errors."""
    if not ref:
        raise ConfigError(f"{what} is not set in the training config")
    resolved = config.resolve(ref)
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
