"""The stop rule that cannot miss its own target: RL leaves the wall budget's end for one more step's work and the
final held-out check (``trainer/stopping.py`` ``WallBudget``, on a controlled clock), and ``lightning-sdk train``
with a nearly spent budget still runs that check, makes it the final evaluation and says it stopped short."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_sdk.trainer.stopping import WallBudget
from tests.trainer.tiny import CLI, ROOT, build_small_policy, write_config


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_rl_is_over_once_a_step_and_the_check_no_longer_fit() -> None:
    clock = Clock()
    budget = WallBudget(100.0, check_s=10.0, clock=clock)  # the evaluation before RL took 10 s
    assert budget.check_reserve_s == pytest.approx(1.25 * 10 + 2)
    clock.now = 80.0
    assert not budget.rl_over()  # 20 s left, 14.5 reserved, no step seen yet
    budget.observe_step(8.0)
    assert budget.rl_over()  # another 8 s step would leave 12 s < 14.5 s for the check
    budget.observe_step(1.0)
    budget.observe_step(1.0)
    budget.observe_step(1.0)  # the slowest of the last three steps counts: 1 s
    assert not budget.rl_over() and budget.step_reserve_s == 1.0
    budget.observe_check(20.0)  # a slower check raises the reserve
    assert budget.check_reserve_s == pytest.approx(27.0) and budget.rl_over()
    budget.observe_check(5.0)  # and a faster one does not lower it
    assert budget.check_reserve_s == pytest.approx(27.0)


@pytest.mark.parametrize("step_s", [2.0, 7.5, 19.0])
def test_the_final_check_ends_within_the_budget_when_steps_and_checks_take_what_was_measured(step_s: float) -> None:
    """A run on the clock: steps of ``step_s`` (waits excluded), checks as long as the evaluation before RL. RL stops
    where the rule says and the check that follows still ends before the budget does; the old rule (RL until the
    deadline, then the evaluation) ends past it."""
    clock = Clock()
    check_s, end = 12.0, 300.0
    budget = WallBudget(end, check_s=check_s, clock=clock)
    clock.now = 40.0  # warm start and the evaluation before RL
    steps = 0
    while not budget.rl_over():
        clock.now += step_s
        budget.observe_step(step_s)
        steps += 1
    clock.now += check_s  # the final check
    assert clock.now <= end and steps >= 1
    assert end - clock.now < step_s + budget.check_reserve_s  # and RL did not stop much earlier than it had to
    old_end = 40.0 + step_s * -(-(end - 40.0) // step_s) + check_s
    assert old_end > end


def test_a_spent_budget_is_over_at_once() -> None:
    clock = Clock()
    clock.now = 50.0
    budget = WallBudget(10.0, clock=clock)
    assert budget.rl_over() and budget.left_s() == -40.0


def _train(config: Path, out: Path) -> tuple[dict[str, Any], str]:
    """``lightning-sdk train CONFIG --output OUT`` in a subprocess: its summary.json and its console output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LIGHTNING_SDK_LOG_LEVEL": "WARNING"}
    proc = subprocess.run(
        [sys.executable, "-c", CLI, "train", str(config), "--output", str(out)],
        cwd=str(ROOT),
        env=env,
        capture_output=True,
        timeout=240,
    )
    output = (proc.stdout + proc.stderr).decode()
    assert proc.returncode == 0, output[-3000:]
    return json.loads((out / "summary.json").read_text()), output


@pytest.fixture(scope="module")
def small_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_small_policy(tmp_path_factory.mktemp("policy") / "tiny", hidden=32, layers=2)


def test_a_run_whose_budget_is_nearly_spent_still_runs_its_check_and_reports_it(
    tmp_path: Path, small_policy: Path
) -> None:
    """``max_wall_s`` of 3 s is spent by the time RL starts. Before, RL ended without a check and the final evaluation
    was a separate ``eval-after``; now the final evaluation is a target check (``eval-check-1``), recorded as the
    last check, and the run says it stopped short of its target because of the wall budget."""
    config = write_config(
        tmp_path / "train.toml",
        str(small_policy),
        warm_start={"enabled": False},
        rl={
            "steps": 40,
            "tasks_per_step": 4,
            "samples_per_task": 4,
            "workers": 8,
            "max_tokens": 16,
            "target_gain": 0.99,  # out of reach
            "max_wall_s": 3,
        },
        eval={"n": 24, "max_tokens": 16, "workers": 8},
    )
    out = tmp_path / "run"
    summary, output = _train(config, out)
    checks = summary["rl"]["checks"]
    assert len(checks) == 1 and checks[0]["final"] is True and checks[0]["reached"] is False, checks
    assert checks[0]["why"] == "wall budget"  # the trigger never fired: the budget made it the last check
    assert summary["eval_after"]["split"] == "eval-check-1"  # the check's own result is the final evaluation
    assert summary["eval_after"]["success_rate"] == checks[0]["success_rate"]
    stop = summary["rl"]["stop"]
    assert stop["reason"] == "max_wall_s" and stop["short"] is True and stop["target_gain"] == 0.99
    assert stop["gain"] == pytest.approx(checks[0]["success_rate"] - summary["eval_before"]["success_rate"])
    assert "stopped short of its target" in summary["stopped_short"] and "max_wall_s" in summary["stopped_short"]
    assert "stopped short of its target" in output  # said on the console too
    with sqlite3.connect(out / "store.db") as conn:
        splits = {s for (s,) in conn.execute("SELECT DISTINCT split FROM rollouts")}
    assert "eval-after" not in splits and "eval-check-1" in splits


def test_a_check_comes_after_check_max_steps_when_the_trigger_never_fires(tmp_path: Path, small_policy: Path) -> None:
    """A target out of reach (its trigger never fires) and ``check_max_steps`` = 2: the whole ``lightning-sdk train``
    checks held-out at step 2 because two steps passed (``why`` = ``max_steps``), then ends at ``rl.steps`` = 3 with
    the final check (``why`` = ``steps``), which is the run's final evaluation. Without ``check_max_steps`` only the
    final one would run."""
    config = write_config(
        tmp_path / "train.toml",
        str(small_policy),
        warm_start={"enabled": False},
        rl={
            "steps": 3,
            "tasks_per_step": 8,
            "samples_per_task": 4,  # 32 fresh rollouts a step: the 64 a check needs after two
            "workers": 8,
            "max_tokens": 16,
            "target_gain": 0.99,  # out of reach
            "check_max_steps": 2,
        },
        eval={"n": 24, "max_tokens": 16, "workers": 8},
    )
    out = tmp_path / "run"
    summary, output = _train(config, out)
    checks = summary["rl"]["checks"]
    assert [(c["step"], c["why"], c["final"]) for c in checks] == [(2, "max_steps", False), (3, "steps", True)], checks
    assert summary["eval_after"]["split"] == "eval-check-2"
    assert summary["rl"]["stop"]["reason"] == "steps" and summary["rl"]["stop"]["short"] is True
    assert "held-out check at step 2 (max_steps)" in output
