"""The main job's acceptance (slow: about ten minutes on two cores): ``lightning-sdk train examples/calc_agent``
with default settings lifts held-out success by at least 30 points from a warm start at or below 40%, within
10 minutes for the whole command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.trainer.tiny import EXAMPLE, ROOT


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_train_calc_agent_meets_the_acceptance(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_sdk", "train", str(EXAMPLE), "--output", str(out)],  # = lightning-sdk
        cwd=str(ROOT),
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    before, after = summary["eval_before"], summary["eval_after"]
    assert before["n"] >= 200 and after["n"] >= 200
    assert before["success_rate"] <= 0.40
    assert after["success_rate"] - before["success_rate"] >= 0.30, summary
    assert wall <= 600, f"the command took {wall:.0f} s"
    assert summary["eval_sampling"]["temperature"] == 0.0
    assert (out / "reward_curve.png").exists()
