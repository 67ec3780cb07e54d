"""Find the agent a command line or config names.

Accepted forms:

* ``package.module:name`` or ``path/to/file.py:name`` — a ``@rollout`` agent, a ``CommandAgent``, or a plain
  function ``(task, llm) -> reward`` (wrapped with ``rollout``);
* ``path/to/agent.yaml`` (or ``.yml`` / ``.json``) — a command agent config, either at the top level or under an
  ``agent:`` key (see ``CommandAgent.from_config``); ``agent: "module:name"`` points at Python code instead;
* a dict (a config section already parsed) — the same two shapes.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from lightning_sdk.agent._base import Agent
from lightning_sdk.agent._command import CommandAgent, _import_path
from lightning_sdk.agent._rollout import RolloutAgent, rollout
from lightning_sdk.errors import ConfigError

__all__ = ["agent_from_config", "import_path", "load_agent"]


def import_path(path: str | Path) -> ModuleType:
    """Import a Python file as a module (once per resolved path), with its directory on ``sys.path`` so it can
    import its neighbours; how ``FILE.py:NAME`` references (agents, task generators) are loaded. Raises
    ``FileNotFoundError`` when the file does not exist, and whatever the file raises while it runs."""
    module: ModuleType = _import_path(Path(path))
    return module


def _as_agent(obj: Any, where: str) -> Agent:
    if isinstance(obj, RolloutAgent | CommandAgent):
        return obj
    if isinstance(obj, Agent):
        return obj
    if isinstance(obj, Mapping):
        return agent_from_config(obj)
    if callable(obj):
        return rollout(obj)
    raise ConfigError(f"{where} is a {type(obj).__name__}; expected a @rollout function, a CommandAgent or a config")


def _load_object(spec: str, base_dir: Path | None = None) -> Agent:
    module_part, _, attr = spec.rpartition(":")
    if not module_part or not attr:
        raise ConfigError(f"agent {spec!r}: expected MODULE:NAME, FILE.py:NAME or a YAML/JSON config file")
    try:
        if module_part.endswith(".py") or "/" in module_part:
            path = Path(module_part)
            if not path.is_absolute() and base_dir is not None:
                path = base_dir / path
            if not path.exists():
                raise ConfigError(f"agent {spec!r}: no file {path}")
            obj: Any = _import_path(path)
        else:
            # like uvicorn and python -m: a module in the current folder is importable by name
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())
            obj = importlib.import_module(module_part)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except ImportError as exc:
        raise ConfigError(f"agent {spec!r}: cannot import {module_part!r}: {exc}") from exc
    except AttributeError as exc:
        raise ConfigError(f"agent {spec!r}: {module_part!r} has no {attr!r}") from exc
    return _as_agent(obj, spec)


def agent_from_config(section: Mapping[str, Any], base_dir: Path | None = None) -> Agent:
    """An agent from a parsed config: a command agent section, or ``{"agent": ...}`` around one / a spec string.
    ``base_dir`` resolves relative paths (see ``CommandAgent.from_config``)."""
    if "agent" in section and "command" not in section:
        inner = section["agent"]
        if isinstance(inner, str):
            return _load_object(inner, base_dir)
        if isinstance(inner, Mapping):
            return CommandAgent.from_config(inner, base_dir)
        raise ConfigError(f"'agent' must be MODULE:NAME or a command section, got {inner!r}")
    return CommandAgent.from_config(section, base_dir)


def load_agent(spec: str | Mapping[str, Any]) -> Agent:
    """The agent named by ``spec`` (see the module docstring)."""
    if isinstance(spec, Mapping):
        return agent_from_config(spec)
    path = Path(spec)
    if path.suffix in {".yaml", ".yml", ".json"}:
        if not path.exists():
            raise ConfigError(f"agent config {path} does not exist")
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            yaml: Any = importlib.import_module("yaml")  # PyYAML ships no type hints
            data = yaml.safe_load(text)
        if not isinstance(data, Mapping):
            raise ConfigError(f"agent config {path} must hold a mapping")
        return agent_from_config(data, path.parent)
    return _load_object(spec)
