"""SIGKILL of the whole ``lightning-sdk train examples/coding_agent`` (its process group) in the middle of RL, then a
restart on the same run directory and sandbox root: the restarted run reaps what the killed one left (sandbox
directories, the harnesses and tool commands still running in them), and once it is stopped (SIGTERM, graceful) no
sandbox directory and no sandboxed process is left.

Cheap on purpose: no warm start and no evaluation (an untrained policy's episodes are one short call), so RL starts
within seconds of the policy being built; the sandboxes, the harness (``coder.py``), the verifier and the whole
command are the real ones. Marked ``slow`` (~1 min: two start-ups of the command)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.sandboxes import sandboxed_processes
from tests.support.waiting import until

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "coding_agent"
SMALL = [
    "--set", "warm_start.enabled=false", "--set", "eval.enabled=false", "--set", "rl.steps=200",
    "--set", "rl.max_wall_s=600", "--set", "rl.workers=8", "--set", "rl.tasks_per_step=2",
    "--set", "rl.samples_per_task=4", "--set", "rl.max_tokens=24",
]  # fmt: skip


def _wait(what: str, cond: Callable[[], bool], proc: subprocess.Popen[bytes], timeout: float = 240) -> None:
    def held() -> bool:
        assert proc.poll() is None, f"the run exited ({proc.returncode}) before {what}"
        return cond()

    until(held, timeout=timeout, what=what, every=0.05)


def _train(out: Path, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "lightning_sdk", "train", str(EXAMPLE), "--output", str(out), *SMALL]
    with open(log, "ab") as f:  # its own process group: the kill below takes the whole command
        return subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_of_the_whole_run_then_restart_leaves_no_sandbox_and_no_process(tmp_path: Path) -> None:
    out, scratch, log = tmp_path / "run", tmp_path / "tmp", tmp_path / "train.log"
    scratch.mkdir()
    boxes = scratch / "lightning-sandboxes"  # the sandboxes live under $TMPDIR/lightning-sandboxes
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(scratch)}

    def dirs() -> list[Path]:
        return [d for d in boxes.iterdir() if d.is_dir()] if boxes.exists() else []

    first = _train(out, env, log)
    try:
        _wait("sandboxed harness", lambda: len(dirs()) >= 2 and bool(sandboxed_processes(boxes)), first)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == -signal.SIGKILL
    left = dirs()
    assert left, "the kill left no sandbox to reap: the test did not exercise anything"
    owners = {json.loads((d / "sandbox.json").read_text())["owner_pid"] for d in left if (d / "sandbox.json").exists()}
    assert owners == {first.pid}

    second = _train(out, env, log)  # same run directory (resumes) and sandbox root
    try:
        _wait("reaping of the killed run's sandboxes", lambda: not set(left) & set(dirs()), second)
        _wait("a new sandbox", lambda: bool(dirs()), second)
        second.send_signal(signal.SIGTERM)  # graceful: attempts released, sandboxes closed, proxy stopped last
        second.wait(timeout=300)
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
    assert second.returncode == 128 + signal.SIGTERM, log.read_text()[-3000:]
    assert dirs() == []
    # a harness of the killed run reaped with SIGKILL is gone once its parent waits
    until(lambda: sandboxed_processes(boxes) == set(), timeout=10, what="the killed run's harnesses to be gone")
