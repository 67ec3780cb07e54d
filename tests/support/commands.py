"""Run a command as a test's child and measure it: wall time, its own peak RSS, the load at its start.

The peak RSS is read by a small wrapper process (``python -S``) that spawns the command and waits for it: a child's
``ru_maxrss`` starts at the high-water mark of the memory image it was forked or vforked from, so waiting for the
command directly from a test process of a few GB would report the test process's peak, not the command's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_WRAPPER = (
    "import json, os, sys\n"
    "pid = os.posix_spawnp(sys.argv[2], sys.argv[2:], os.environ)\n"
    "_, status, usage = os.wait4(pid, 0)\n"
    "with open(sys.argv[1], 'w') as f:\n"
    "    json.dump({'returncode': os.waitstatus_to_exitcode(status), 'maxrss_kb': usage.ru_maxrss}, f)\n"
)


@dataclass
class Measured:
    returncode: int
    wall_s: float
    peak_rss_mb: float  # the command's own peak resident set
    load_start: float  # the 1-minute load average when it started
    stderr: str


def run_measured(argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], stderr_path: Path) -> Measured:
    """Run ``argv`` to its end (stdout discarded, stderr kept in ``stderr_path``); if the caller is interrupted (a
    test timeout), the command's process group is killed so that no training is left behind."""
    result = stderr_path.with_name(stderr_path.name + ".rusage.json")
    load_start = os.getloadavg()[0]
    t0 = time.monotonic()
    with open(stderr_path, "w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-S", "-c", _WRAPPER, str(result), *argv],
            cwd=str(cwd),
            env=dict(env),
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
        try:
            proc.wait()
        finally:
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        wall = time.monotonic() - t0
        err.seek(0)
        measured = json.loads(result.read_text())
        return Measured(measured["returncode"], wall, measured["maxrss_kb"] / 1024, load_start, err.read())


def train_example(example: Path, out: Path, tmp_path: Path, env: Mapping[str, str] | None = None) -> Measured:
    """``lightning-sdk train EXAMPLE --output OUT`` (as ``python -m lightning_sdk``) from the repository root,
    measured (stderr in ``tmp_path/stderr.txt``); ``env`` defaults to this process's with the repository on
    ``PYTHONPATH``. A failed command fails the test with its stderr."""
    root = Path(__file__).resolve().parents[2]
    run = run_measured(
        [sys.executable, "-m", "lightning_sdk", "train", str(example), "--output", str(out)],
        cwd=root,
        env=env if env is not None else {**os.environ, "PYTHONPATH": str(root)},
        stderr_path=tmp_path / "stderr.txt",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def merged_rollouts(run_dir: Path, tokenizer: Path, tmp_path: Path, env: Mapping[str, str]) -> list[dict[str, Any]]:
    """``lightning-sdk records --report`` over a finished run's train split: asserts every succeeded rollout merged into
    one segment (no split, nothing truncated) and returns their report rows (``calls``, ``segments``...); the records
    themselves are in ``tmp_path/records.jsonl``."""
    root = Path(__file__).resolve().parents[2]
    report = tmp_path / "report.json"
    rec = subprocess.run(
        [sys.executable, "-m", "lightning_sdk", "records", "--store", str(run_dir / "store.db"), "--out",
         str(tmp_path / "records.jsonl"), "--tokenizer", str(tokenizer), "--split", "train", "--report", str(report)],
        cwd=str(root), env=dict(env), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert rec.returncode == 0, rec.stderr[-3000:]
    data = json.loads(report.read_text())
    merged = [r for r in data["rollouts"] if r["status"] == "succeeded"]
    assert merged and data["summary"]["split_reasons"] == {} and data["summary"]["truncated_segments"] == 0
    assert all(r["segments"] == 1 for r in merged), [r for r in merged if r["segments"] != 1][:3]
    return merged
