"""How a command agent gets its sandbox (``SandboxSpec``) and the registry that makes backends by name.

``BackendRegistry`` maps a backend name to its factory and keeps one backend per (name, options), so every agent of
a process that asks for the same backend shares its cap. ``BACKENDS`` is the process's registry; register another
backend with ``BACKENDS.register("name", factory)``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_sdk.errors import ConfigError
from lightning_sdk.sandbox._base import SandboxBackend, SandboxLimits
from lightning_sdk.sandbox._local import LocalBackend

__all__ = ["BACKENDS", "BackendRegistry", "SandboxSpec", "get_backend"]

_OPTIONS = ("max_sandboxes", "root", "create_timeout_s", "isolation", "uid_range", "readable")


class BackendRegistry:
    """Backend factories by name, and the backends made (one per distinct options)."""

    def __init__(self) -> None:
        self._factories: dict[str, Callable[..., SandboxBackend]] = {}
        self._made: dict[tuple[str, tuple[tuple[str, str], ...]], SandboxBackend] = {}
        self._lock = threading.Lock()

    def register(self, name: str, factory: Callable[..., SandboxBackend]) -> None:
        with self._lock:
            self._factories[name] = factory

    def names(self) -> list[str]:
        return sorted(self._factories)

    def get(self, name: str = "local", **options: Any) -> SandboxBackend:
        """The backend of ``name`` with ``options``, made on first use."""
        key = (name, tuple(sorted((k, str(v)) for k, v in options.items())))
        with self._lock:
            if key not in self._made:
                factory = self._factories.get(name)
                if factory is None:
                    raise ConfigError(f"unknown sandbox backend {name!r}; available: {', '.join(self.names())}")
                self._made[key] = factory(**options)
            return self._made[key]


BACKENDS = BackendRegistry()
BACKENDS.register("local", LocalBackend)


def get_backend(name: str = "local", **options: Any) -> SandboxBackend:
    """The process-wide backend of ``name`` with ``options`` (``BACKENDS.get``)."""
    return BACKENDS.get(name, **options)


@dataclass(frozen=True)
class SandboxSpec:
    """How a command agent gets its sandbox: which task field holds the repository files, the limits, the backend.

    ``files_field`` names a task field holding ``{path: text}``; ``backend`` is a registered backend name
    (``"local"``) with ``backend_options`` (for the local one: ``root``, ``max_sandboxes``, ``create_timeout_s``,
    ``isolation``, ``uid_range``, ``readable``).
    """

    files_field: str = "repo"
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    backend: str = "local"
    backend_options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, section: Mapping[str, Any]) -> SandboxSpec:
        known = {"files_field", "limits", "backend", *_OPTIONS}
        unknown = sorted(set(section) - known)
        if unknown:
            raise ConfigError(f"unknown sandbox keys {unknown}; known: {sorted(known)}")
        options = {k: section[k] for k in _OPTIONS if k in section}
        return cls(
            files_field=str(section.get("files_field", "repo")),
            limits=SandboxLimits.from_config(section.get("limits")),
            backend=str(section.get("backend", "local")),
            backend_options=options,
        )

    def files_of(self, task: Mapping[str, Any]) -> Mapping[str, str]:
        files = task.get(self.files_field)
        if not isinstance(files, Mapping):
            raise ConfigError(f"the task has no {self.files_field!r} mapping of path -> text for its sandbox")
        return files

    def get_backend(self, registry: BackendRegistry | None = None) -> SandboxBackend:
        return (registry or BACKENDS).get(self.backend, **dict(self.backend_options))

    def summary(self) -> dict[str, Any]:
        """What these sandboxes are held to, for the run's summary: the backend's name and its ``describe()``
        (``describe_enforcement`` of its isolation)."""
        backend = self.get_backend()
        return {"backend": backend.name, **backend.describe()}
