"""Import a script that is not part of a package (``benchmarks/*.py``, ``scripts/*.py``, an example's ``tasks.py``)
by its path, as the trainer imports an example's modules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path, name: str, *, register: bool = False) -> ModuleType:
    """The module in ``path``, executed under ``name``; ``register`` also puts it in ``sys.modules`` (needed where
    its own code looks itself up there, e.g. dataclasses or pickling)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
