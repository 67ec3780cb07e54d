"""``[learner] process``: the embedded learner in a child process (``lightning_sdk/trainer/process.py``).

Real spawned processes, a real (small) policy on disk, real records: the child's steps give the update the learner
gives in this process, the parent's weights reach it with ``reset_optimizer``, its state round-trips, its errors come
back with their type and a dead child is an error, never a hang."""

from __future__ import annotations

import asyncio
import copy
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lightning_sdk.errors import ConfigError, TrainerError
from lightning_sdk.policy.model import load_policy
from lightning_sdk.records.record import CallSpan, Record, Segment
from lightning_sdk.trainer.learner import Learner, LearnerConfig
from lightning_sdk.trainer.process import ProcessLearner
from tests.trainer.tiny import build_small_policy


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_small_policy(tmp_path_factory.mktemp("policy") / "tiny", hidden=32, layers=2)


def _records(seed: int, trained: bool = True) -> list[Record]:
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate([9, 12, 7, 10]):
        ids = rng.integers(10, 200, n).astype(np.int32)
        mask = np.array([0] * 4 + [1 if trained else 0] * (n - 4), dtype=np.int8)
        seg = Segment(attempt_id=f"a{i}", rollout_id=f"r{i}", index=0, input_ids=ids, loss_mask=mask,
                      logprobs=-0.5 * mask.astype(np.float64),
                      spans=(CallSpan(call_id=f"c{i}", seq=0, start=4, end=n, policy_version=0),))  # fmt: skip
        out.append(Record(seg, "g", float(i % 2), (1.0 if i % 2 else -1.0) * mask.astype(np.float64), weight=0.5))
    return out


@pytest.fixture
def child(policy_dir: Path) -> Iterator[tuple[ProcessLearner, Any]]:
    model, _ = load_policy(policy_dir)
    learner = ProcessLearner(policy_dir, LearnerConfig(lr=1e-3, warmup_steps=1, ppo_epochs=2), model, pad_id=0)
    try:
        yield learner, model
    finally:
        learner.close()


def test_the_child_steps_as_the_learner_in_this_process(policy_dir: Path, child: tuple[ProcessLearner, Any]) -> None:
    learner, model = child
    assert learner.pid != os.getpid() and learner.where()["pid"] == learner.pid
    here = Learner(copy.deepcopy(model), LearnerConfig(lr=1e-3, warmup_steps=1, ppo_epochs=2))
    for seed in (1, 2, 3):
        a, b = learner.step(_records(seed)), here.step(_records(seed))
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["updates"] == 2.0 and a["thread_cpu_s"] > 0
    assert learner.steps == 3
    theirs, ours = learner.weights(), here.weights()
    assert theirs.keys() == ours.keys()
    moved = max(float((ours[k] - model.state_dict()[k]).abs().max()) for k in ours)
    assert moved > 1e-4  # three steps changed the weights
    for k in ours:
        assert torch.allclose(theirs[k], ours[k], atol=1e-6), k


def test_reset_optimizer_hands_the_parents_weights_to_the_child(child: tuple[ProcessLearner, Any]) -> None:
    learner, model = child
    learner.step(_records(1))
    with torch.no_grad():  # what a warm start does to the parent's copy
        for p in model.parameters():
            p.add_(0.01)
    learner.reset_optimizer()
    assert learner.steps == 0
    got = learner.weights()
    for k, v in model.state_dict().items():
        assert torch.equal(got[k], v), k
    state = learner.state_dict()
    assert state["steps"] == 0 and state["optimizer"]["state"] == {}  # fresh moments


def test_state_dict_round_trip_resumes_exactly(policy_dir: Path, child: tuple[ProcessLearner, Any]) -> None:
    learner, model = child
    learner.step(_records(1))
    state = learner.state_dict()
    after = learner.step(_records(2))
    expected = learner.weights()
    other = ProcessLearner(policy_dir, LearnerConfig(lr=1e-3, warmup_steps=1, ppo_epochs=2), model, pad_id=0)
    try:
        other.load_state_dict(state)
        assert other.steps == 1
        assert other.step(_records(2))["loss"] == pytest.approx(after["loss"], abs=1e-7)
        for k, v in other.weights().items():
            assert torch.equal(v, expected[k]), k
    finally:
        other.close()


def test_a_failing_step_raises_its_own_error_and_the_child_goes_on(
    child: tuple[ProcessLearner, Any],
) -> None:
    learner, _ = child
    with pytest.raises(TrainerError, match="no trained tokens"):
        learner.step(_records(1, trained=False))
    assert learner.steps == 0
    assert learner.step(_records(1))["updates"] == 2.0  # still serving


def test_the_threads_the_balance_sets_go_with_each_step(child: tuple[ProcessLearner, Any]) -> None:
    learner, _ = child
    learner.config = learner.config.model_copy(update={"threads": 1})
    learner.step(_records(1))
    learner.config = learner.config.model_copy(update={"threads": 2})
    learner.step(_records(2))
    assert learner.state_dict()["steps"] == 2


def test_a_dead_child_is_an_error_not_a_hang(child: tuple[ProcessLearner, Any]) -> None:
    learner, _ = child
    os.kill(learner.pid, signal.SIGKILL)
    with pytest.raises(TrainerError, match=r"learner process (died|is not running).*exit code -9"):
        learner.step(_records(1))
    learner.close()  # closing a dead child is fine


def test_a_child_that_cannot_start_says_why(tmp_path: Path, policy_dir: Path) -> None:
    model, _ = load_policy(policy_dir)
    with pytest.raises(ConfigError, match="not a Hugging Face model directory"):
        ProcessLearner(tmp_path / "missing", LearnerConfig(), model, pad_id=0)


def test_process_needs_the_embedded_engine_and_no_lora(policy_dir: Path, tmp_path: Path) -> None:
    from lightning_sdk.app.parts import build_parts
    from lightning_sdk.engines.serving import EngineConfig
    from lightning_sdk.trainer.learner import LoraSettings

    with pytest.raises(ConfigError, match=r"learner\.process with learner\.lora"):
        build_parts(
            tmp_path, policy_dir, engine=EngineConfig(), learner=LearnerConfig(process=True, lora=LoraSettings())
        )


def test_the_warm_start_serves_the_parents_weights_until_the_child_gets_them(policy_dir: Path, tmp_path: Path) -> None:
    """``build_parts`` with ``process``: the warm start trains ``parts.model`` here, so its evaluations must serve
    that copy (``Parts.warm_start_weights``), not the child's untouched weights; the child gets them at its end."""
    from lightning_sdk.app.parts import build_parts
    from lightning_sdk.engines.serving import EngineConfig

    parts = build_parts(tmp_path, policy_dir, engine=EngineConfig(), learner=LearnerConfig(process=True))
    try:
        assert isinstance(parts.learner, ProcessLearner) and parts.model is not None
        with torch.no_grad():  # a warm start's steps
            for p in parts.model.parameters():
                p.mul_(0.5)
        assert parts.warm_start_weights is not None
        served, child = parts.warm_start_weights(), parts.weights()
        mine = parts.model.state_dict()
        assert all(torch.equal(served[k], v) for k, v in mine.items())
        assert not all(torch.equal(child[k], v) for k, v in mine.items())  # the child has not seen them yet
        parts.learner.reset_optimizer()  # the warm start's end
        child = parts.weights()
        assert all(torch.equal(child[k], v) for k, v in mine.items())
    finally:
        for close in parts.closers:
            close()
        asyncio.run(parts.engine.close())


def test_train_with_the_learner_in_a_child_process(tmp_path: Path, policy_dir: Path) -> None:
    """``lightning-sdk train`` end to end with ``[learner] process = true``: warm start, RL steps trained by the
    child (its step thread's CPU in metrics.jsonl) and the model saved from its weights."""
    import json
    import subprocess
    import sys

    from tests.trainer.tiny import CLI, ROOT, write_config

    config = write_config(
        tmp_path / "train.toml",
        str(policy_dir),
        warm_start={"max_steps": 2, "eval_every": 1, "eval_below_loss": 100.0, "target_success": 1.0,
                    "batch_size": 4, "validation_tasks": 4},
        rl={"steps": 2, "tasks_per_step": 2, "samples_per_task": 2, "workers": 4, "max_tokens": 16,
            "drop_zero_variance": False},
        learner={"process": True},
        eval={"n": 4, "max_tokens": 16, "workers": 4},
    )  # fmt: skip
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LIGHTNING_SDK_LOG_LEVEL": "WARNING"}
    proc = subprocess.run(
        [sys.executable, "-c", CLI, "train", str(config), "--output", str(out)],
        cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["warm_start"]["steps"] == 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["thread_cpu_s"] > 0 and r["updates"] >= 1 for r in rows)
    saved, _ = load_policy(Path(summary["model_dir"]))
    start, _ = load_policy(out / "policy_init") if (out / "policy_init").exists() else load_policy(policy_dir)
    with torch.no_grad():
        pairs = zip(saved.parameters(), start.parameters(), strict=True)
        moved = max(float((a - b).abs().max()) for a, b in pairs)
    assert moved > 0  # the warm start's and the child's steps are in the saved model
