"""The sandbox interface: limits, results, the ``Sandbox`` and ``SandboxBackend`` contracts (the spec and the
backend registry are in ``_spec``).

A backend creates sandboxes from a repository state (``files``: relative path -> text); a sandbox runs commands
(``exec``: run to completion, output captured and truncated) and programs (``start``: an asyncio subprocess the
caller talks to), gives its files back (``snapshot``) and is closed exactly once (``close``: idempotent). The local
process backend implements it now; a container backend implements the same four calls.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

from lightning_sdk.errors import ConfigError, SandboxError

__all__ = [
    "ExecResult",
    "Sandbox",
    "SandboxBackend",
    "SandboxError",
    "SandboxLimits",
]


@dataclass(frozen=True)
class SandboxLimits:
    """Per-sandbox limits. ``wall_s``: the sandbox's whole life; the others apply to each process in it."""

    wall_s: float = 300.0
    cpu_s: int = 60
    memory_mb: int = 1024
    file_size_mb: int = 16
    max_processes: int = 64
    max_open_files: int = 256
    network: bool = False  # False: exec() runs in an empty network namespace where the OS permits it
    output_bytes: int = 64_000  # exec() keeps at most this much of stdout and of stderr

    @classmethod
    def from_config(cls, section: Mapping[str, Any] | None) -> SandboxLimits:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(section or {}) - names)
        if unknown:
            raise ConfigError(f"unknown sandbox limit(s) {unknown}; known: {sorted(names)}")
        limits = cls(**dict(section or {}))
        for name in names - {"network"}:
            if getattr(limits, name) <= 0:
                raise ConfigError(f"sandbox limit {name} must be > 0, got {getattr(limits, name)}")
        return limits


@dataclass(frozen=True)
class ExecResult:
    """One command run to completion (or killed): exit code (negative: killed by that signal), truncated output."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False


class Sandbox(abc.ABC):
    """One sandbox: a directory holding the repository state and the processes running in it."""

    id: str
    path: str  # the working directory (the repository root)
    home: str  # its private home directory
    uid: int | None  # the uid its programs run as (per-sandbox-user isolation); None: the trainer's own
    limits: SandboxLimits

    @abc.abstractmethod
    def write_private(self, name: str, text: str) -> str:
        """Write a file in the sandbox's home that only its programs (and the trainer) can read; its path."""

    @abc.abstractmethod
    def exit_code(self, proc: asyncio.subprocess.Process) -> int | None:
        """The exit code of a program ``start`` started, once it ended (negative: killed by that signal)."""

    @abc.abstractmethod
    async def fresh(self, files: Mapping[str, str]) -> Sandbox:
        """A new sandbox of the same backend and limits holding ``files`` (e.g. this one's snapshot + hidden tests,
        for a verifier). It shares this sandbox's slot under the backend's cap (so verifying never waits for a slot
        that attempts hold); close it like any other."""

    @abc.abstractmethod
    async def exec(
        self,
        command: Sequence[str] | str,
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Run ``command`` (a list, or a string run by ``bash -c``) in the sandbox to completion."""

    @abc.abstractmethod
    async def start(
        self, command: Sequence[str], *, env: Mapping[str, str] | None = None, network: bool = True
    ) -> asyncio.subprocess.Process:
        """Start a program in the sandbox (stdout/stderr piped, stdin closed) under its limits; ``close`` kills it."""

    @abc.abstractmethod
    async def kill_processes(self) -> int:
        """Kill every process of the sandbox now; returns how many process groups were signalled."""

    @abc.abstractmethod
    def snapshot(self, max_bytes: int = 4_000_000) -> dict[str, str]:
        """The sandbox's text files (relative path -> content), e.g. to build a fresh copy for a verifier."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Kill every process and delete everything; idempotent, never raises for an already-closed sandbox."""

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class SandboxBackend(Protocol):
    """Creates sandboxes. ``create`` waits for a free slot under the backend's cap."""

    name: str
    max_sandboxes: int
    isolation: str  # describe_enforcement's name of the isolation its sandboxes get

    async def create(self, files: Mapping[str, str], limits: SandboxLimits | None = None) -> Sandbox: ...

    def active(self) -> int:
        """How many sandboxes of this backend exist now."""
        ...

    def describe(self) -> dict[str, str]:
        """What its sandboxes are held to (``describe_enforcement`` of its isolation)."""
        ...
