"""tests/support/commands.run_measured, which the acceptance tests use to time the training command and read its
peak RSS: real child processes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.support.commands import run_measured, train_example


def test_measures_the_childs_own_peak_rss_exit_code_and_stderr(tmp_path: Path) -> None:
    script = "import sys; block = bytearray(200 * 1024 * 1024); sys.stderr.write('done'); sys.exit(3)"
    run = run_measured([sys.executable, "-c", script], cwd=tmp_path, env=os.environ, stderr_path=tmp_path / "e.txt")
    assert run.returncode == 3
    assert run.stderr == "done" and (tmp_path / "e.txt").read_text() == "done"
    assert 200 <= run.peak_rss_mb < 400  # the 200 MB block, counted once
    assert run.wall_s > 0 and run.load_start >= 0


def test_the_peak_is_the_commands_not_the_callers(tmp_path: Path) -> None:
    """A child forked from a process of 300 MB starts with that high-water mark; the command measured must not."""
    ballast = bytearray(300 * 1024 * 1024)
    ballast[::4096] = b"x" * len(ballast[::4096])  # touched: resident
    run = run_measured([sys.executable, "-c", "pass"], cwd=tmp_path, env=os.environ, stderr_path=tmp_path / "e.txt")
    assert run.returncode == 0
    assert run.peak_rss_mb < 100, run.peak_rss_mb
    del ballast


def test_a_killed_child_reports_the_signal(tmp_path: Path) -> None:
    script = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    run = run_measured([sys.executable, "-c", script], cwd=tmp_path, env=os.environ, stderr_path=tmp_path / "e.txt")
    assert run.returncode == -9


def test_train_example_fails_the_test_with_the_commands_error(tmp_path: Path) -> None:
    """The real ``lightning-sdk train`` on a directory with no train.toml: a clear CLI error, shown in the failure."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(AssertionError) as failed:
        train_example(tmp_path / "empty", tmp_path / "run", tmp_path)
    assert "train.toml" in str(failed.value)
