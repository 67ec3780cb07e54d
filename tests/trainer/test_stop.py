"""Stopping and failing cleanly: ``lightning-sdk train`` / ``daemon`` under SIGTERM, and clear one-line errors for a
bad or busy port and an unusable ``--output``.

Every test runs the real command in a subprocess (SQLite store, proxy on a loopback port, embedded engine, the calc
example's agent in process, learner, checkpoints). A graceful stop releases in-flight attempts, checkpoints the
step in progress and stops the proxy last: ``train`` exits 143 (128 + SIGTERM), ``daemon`` exits 0.
"""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from lightning_sdk.app.job import prepare_run_dir
from lightning_sdk.errors import ConfigError
from lightning_sdk.trainer.checkpoint import load_checkpoint
from tests.support.waiting import until
from tests.trainer.tiny import CLI, ROOT, build_small_policy, write_config

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "LIGHTNING_SDK_LOG_LEVEL": "WARNING"}
LONG_WARM_START = {"enabled": True, "max_steps": 100000, "eval_below_loss": 0.0, "batch_size": 4}


@pytest.fixture(scope="module")
def small_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_small_policy(tmp_path_factory.mktemp("policy") / "tiny", hidden=32, layers=2)


def _cli(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CLI, *args],
        cwd=str(ROOT),
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for(proc: subprocess.Popen[str], ready: Callable[[], object], timeout: float = 60.0) -> None:
    def held() -> bool:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        return bool(ready())

    until(held, timeout=timeout, what="the run", every=0.05)


class Output:
    """The lines a running command printed so far (read by a thread, so the test can wait for one)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
        self._reader.start()

    def index(self, text: str) -> int | None:
        """The number of the first line containing ``text`` (None: not printed yet)."""
        return next((i for i, line in enumerate(list(self.lines)) if text in line), None)

    def value(self, prefix: str) -> str | None:
        return next((line.split(": ", 1)[1].strip() for line in list(self.lines) if line.startswith(prefix)), None)

    def rest(self) -> str:
        self._reader.join(timeout=10)
        return "".join(self.lines)


def _stop(proc: subprocess.Popen[str], output: Output) -> tuple[int, str]:
    """SIGTERM, then the exit code and everything the command printed."""
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"still running 30 s after SIGTERM:\n{output.rest()[-3000:]}") from None
    return code, output.rest()


def _terminate(proc: subprocess.Popen[str]) -> tuple[int, str, float]:
    """SIGTERM, then the exit code, the output and how long the stop took (printed, not asserted)."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"still running 30 s after SIGTERM:\n{out[-3000:]}") from None
    took = time.monotonic() - t0
    print(f"stopped {took:.2f} s after SIGTERM")
    return proc.returncode, out, took


def _store_state(db: Path) -> tuple[dict[str, int], dict[str, int]]:
    with sqlite3.connect(db) as conn:
        consumed = conn.execute(
            "SELECT group_id, consumed_step FROM groups WHERE split = 'train' AND consumed_step IS NOT NULL"
        ).fetchall()
        statuses = conn.execute("SELECT status, COUNT(*) FROM attempts GROUP BY status").fetchall()
    return {g: int(s) for g, s in consumed}, {str(s): int(n) for s, n in statuses}


def test_train_sigterm_mid_rl_releases_attempts_checkpoints_and_exits(tmp_path: Path, small_policy: Path) -> None:
    config = write_config(
        tmp_path / "train.toml",
        str(small_policy),
        warm_start={"enabled": False},
        rl={
            "steps": 1000,
            "tasks_per_step": 2,
            "samples_per_task": 2,
            "workers": 8,
            "max_tokens": 16,
            "drop_zero_variance": False,
            "max_wall_s": 1000,
        },
        eval={"enabled": False},
    )
    out = tmp_path / "run"
    proc = _cli("train", str(config), "--output", str(out))
    _wait_for(proc, lambda: (out / "checkpoint.pt").exists() and (load_checkpoint(out) or None) is not None)
    code, output, _ = _terminate(proc)
    assert code == 143, output[-3000:]
    assert "stopped at step" in output and "re-run with the same --output" in output
    assert "Traceback" not in output and "ConnectError" not in output, output[-3000:]
    ckpt = load_checkpoint(out)
    assert ckpt is not None and ckpt.step >= 1
    consumed, statuses = _store_state(out / "store.db")
    # the store and the checkpoint agree on every consumed group, and no attempt was left running
    assert consumed == {g: s for s, e in ckpt.consumed.items() for g in e["trained"] + e["dropped"]}
    assert statuses.get("running", 0) == 0, statuses
    assert not (out / "summary.json").exists()  # an interrupted run resumes; it has no summary yet


def _attempts(db: Path) -> dict[tuple[str, str], int]:
    """(split, status) -> attempts, read while the run writes (a missing file or table reads as none)."""
    if not db.exists():
        return {}
    try:
        with sqlite3.connect(db, timeout=5) as conn:
            rows = conn.execute(
                "SELECT r.split, a.status, COUNT(*) FROM attempts a JOIN rollouts r USING (rollout_id) "
                "GROUP BY r.split, a.status"
            ).fetchall()
    except sqlite3.OperationalError:
        return {}
    return {(str(split), str(status)): int(n) for split, status, n in rows}


def test_train_sigterm_during_the_evaluation_before_rl_releases_the_rl_workers_too(
    tmp_path: Path, small_policy: Path
) -> None:
    """The RL workers start with the evaluation before RL (``[rl] generate_during_eval``): a stop then releases
    both pools' attempts, and the run exits cleanly with no checkpoint (no step was trained)."""
    config = write_config(
        tmp_path / "train.toml",
        str(small_policy),
        warm_start={"enabled": False},
        rl={"steps": 5, "tasks_per_step": 2, "samples_per_task": 2, "workers": 4, "max_tokens": 16},
        eval={"n": 200, "workers": 1, "max_tokens": 16},  # one task at a time: still running when stopped
    )
    out = tmp_path / "run"
    proc = _cli("train", str(config), "--output", str(out))
    db = out / "store.db"
    _wait_for(
        proc, lambda: _attempts(db).get(("train", "succeeded"), 0) >= 1 and ("eval-before", "running") in _attempts(db)
    )
    code, output, _ = _terminate(proc)
    assert code == 143, output[-3000:]
    assert "Traceback" not in output and "ConnectError" not in output, output[-3000:]
    attempts = _attempts(db)
    assert not any(status == "running" for _, status in attempts), attempts
    assert attempts.get(("eval-before", "succeeded"), 0) < 200
    assert load_checkpoint(out) is None and not (out / "summary.json").exists()


def test_train_sigterm_during_warm_start_exits_promptly(tmp_path: Path, small_policy: Path) -> None:
    config = write_config(tmp_path / "train.toml", str(small_policy), warm_start=LONG_WARM_START)
    out = tmp_path / "run"
    proc = _cli("train", str(config), "--output", str(out))
    printed = Output(proc)
    _wait_for(proc, lambda: printed.index(": warm start") is not None)  # the (endless) warm start has begun
    code, output = _stop(proc, printed)
    assert code == 143, output[-3000:]
    assert "stopped at step 0" in output and "Traceback" not in output, output[-3000:]
    assert not (out / "checkpoint.pt").exists()


def test_daemon_prints_its_key_before_the_warm_start_and_stops_on_sigterm(tmp_path: Path, small_policy: Path) -> None:
    import json

    config = write_config(tmp_path / "daemon.toml", str(small_policy), warm_start=LONG_WARM_START)
    out = tmp_path / "run"
    proc = _cli("daemon", "--config", str(config), "--output", str(out))
    printed = Output(proc)
    _wait_for(proc, lambda: printed.index(": warm start") is not None, timeout=60)  # the endless warm start began
    url, key = printed.value("trainer daemon ready: "), printed.value("admin key: ")
    assert json.loads((out / "daemon.json").read_text()) == {"url": url, "admin_key": key}
    ready, warm = printed.index("trainer daemon ready: "), printed.index(": warm start")
    assert ready is not None and warm is not None and ready < warm  # the key came before the warm start
    assert proc.poll() is None
    code, rest = _stop(proc, printed)
    assert code == 0, rest[-3000:]
    assert "stopped at step 0" in rest and "Traceback" not in rest, rest[-3000:]
    assert not (out / "checkpoint.pt").exists()


@pytest.mark.parametrize("kind", ["busy", "out-of-range"])
def test_daemon_bad_port_is_a_one_line_error_before_building_the_policy(tmp_path: Path, kind: str) -> None:
    config = write_config(tmp_path / "daemon.toml", "tiny", warm_start={"enabled": False})
    out = tmp_path / "run"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1] if kind == "busy" else 99999
        proc = _cli("daemon", "--config", str(config), "--output", str(out), "--port", str(port))
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, output
    assert "Traceback" not in output and "SystemExit" not in output, output
    if kind == "busy":
        assert f"cannot listen on 127.0.0.1:{port}" in output
    else:
        assert "--port 99999 is not a TCP port (0-65535)" in output
    assert not (out / "policy_init").exists()  # failed before the (slow) policy build


@pytest.mark.parametrize("command", ["train", "daemon"])
def test_output_that_is_a_file_is_a_one_line_error(tmp_path: Path, command: str) -> None:
    config = write_config(tmp_path / "train.toml", "tiny", warm_start={"enabled": False})
    taken = tmp_path / "taken"
    taken.write_text("not a directory")
    args = [str(config)] if command == "train" else ["--config", str(config)]
    proc = _cli(command, *args, "--output", str(taken))
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, output
    assert f"--output {taken}: exists and is not a directory" in " ".join(output.split()), output
    assert "Traceback" not in output
    assert taken.read_text() == "not a directory"


def test_unwritable_output_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="cannot write there"):
        prepare_run_dir(tmp_path / "file" / "run")  # a path below a file can never be created
    made = prepare_run_dir(tmp_path / "a" / "b")
    assert made.is_dir() and list(made.iterdir()) == []
