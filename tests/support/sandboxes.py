"""Processes of the sandboxes under a root, for the tests that check nothing is left behind."""

from __future__ import annotations

import os
from pathlib import Path


def sandboxed_processes(root: Path) -> set[int]:
    """Live processes of sandboxes under ``root``: the sandbox's environment marker, and ``root`` in their environment
    (their TMPDIR is inside their sandbox), so sandboxes of other runs on the machine do not count."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                env = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:
                continue
            if b"LIGHTNING_SANDBOX_ID=" in env and str(root).encode() in env:
                found.add(int(entry))
    return found
