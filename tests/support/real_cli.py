"""The pinned real coding-agent CLIs (Claude Code, Codex CLI) from npm, for the ``real_cli`` tests: installed on first
use into a cache outside the repository (``$LIGHTNING_SDK_REAL_CLI_DIR``, default ``~/.cache/lightning_sdk_real_cli``;
``.ci/run`` installs them in its ``real-cli-install`` stage). Import ``cli_bin`` into a test module to use it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

__all__ = ["PACKAGES", "cli_bin"]

PACKAGES = {"claude": "@anthropic-ai/claude-code@2.1.328", "codex": "@openai/codex@0.169.0"}
"""The pinned CLI packages (the versions the wire formats were read from)."""


def _cli_dir() -> Path:
    return Path(os.environ.get("LIGHTNING_SDK_REAL_CLI_DIR", Path.home() / ".cache" / "lightning_sdk_real_cli"))


def _installed(root: Path, package: str) -> bool:
    name, _, version = package.rpartition("@")
    manifest = root / "node_modules" / name / "package.json"
    return manifest.exists() and json.loads(manifest.read_text()).get("version") == version


@pytest.fixture(scope="session")
def cli_bin() -> Path:
    """``node_modules/.bin`` of the pinned CLIs (installed with npm on first use)."""
    root = _cli_dir()
    if not all(_installed(root, p) for p in PACKAGES.values()):
        if shutil.which("npm") is None:
            pytest.fail("the real_cli tests need node and npm (Node >= 20) on PATH")
        root.mkdir(parents=True, exist_ok=True)
        cmd = ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(root), *PACKAGES.values()]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"npm install failed:\n{proc.stdout}\n{proc.stderr}"
    return root / "node_modules" / ".bin"
