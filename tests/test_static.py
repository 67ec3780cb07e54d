"""The test command also lints and type-checks: ruff on the whole tree, mypy strict on lightning_sdk/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_clean() -> None:
    proc = _run("ruff", "check", "lightning_sdk", "integrations", "tests", "examples", "benchmarks")
    assert proc.returncode == 0, proc.stdout + proc.stderr


# A cold mypy run of the whole package takes ~60 s on a quiet machine and over 300 s (pytest's default timeout) on
# a loaded one (seen at load 10): the run's own 600 s bound applies instead.
@pytest.mark.timeout(900)
def test_mypy_strict_clean() -> None:
    proc = _run("mypy", "--strict", "lightning_sdk")
    assert proc.returncode == 0, proc.stdout + proc.stderr
