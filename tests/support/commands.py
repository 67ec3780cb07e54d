"""Run a command as a test's child and measure it: wall time, its own peak RSS (``wait4``), the load at its start."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Measured:
    returncode: int
    wall_s: float
    peak_rss_mb: float  # the child's own peak resident set (its rusage from wait4)
    load_start: float  # the 1-minute load average when it started
    stderr: str


def run_measured(argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], stderr_path: Path) -> Measured:
    """Run ``argv`` to its end (stdout discarded, stderr kept in ``stderr_path``); if the caller is interrupted (a
    test timeout), the child is killed so that no training is left behind."""
    load_start = os.getloadavg()[0]
    t0 = time.monotonic()
    with open(stderr_path, "w+") as err:
        proc = subprocess.Popen(list(argv), cwd=str(cwd), env=dict(env), stdout=subprocess.DEVNULL, stderr=err)
        reaped = False
        try:
            _, status, usage = os.wait4(proc.pid, 0)
            reaped = True
        finally:
            if not reaped:
                proc.kill()
                proc.wait()
        wall = time.monotonic() - t0
        err.seek(0)
        return Measured(os.waitstatus_to_exitcode(status), wall, usage.ru_maxrss / 1024, load_start, err.read())
