"""The echo agent example (examples/echo_agent): SmolLM2-135M-Instruct trained with a LoRA adapter from
``lightning-sdk train``. The task split and the reward are checked fast; a shortened run of the example itself
(marker ``slow``) trains real rows, changes only the adapted weights and measures the held-out set with the
configured ``n``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from safetensors.torch import load_file

from lightning_sdk.agent.loader import import_path
from tests.trainer.tiny import CLI, ROOT

EXAMPLE = ROOT / "examples" / "echo_agent"


def _tasks() -> ModuleType:
    return import_path(EXAMPLE / "tasks.py")  # as `lightning-sdk train` loads "tasks.py:train_tasks"


def test_heldout_words_are_never_asked_for_in_training() -> None:
    tasks = _tasks()
    train, heldout = tasks.train_tasks(), tasks.heldout_tasks()
    assert len(heldout) >= 100 and len(train) > 3 * len(heldout)
    assert not {t["answer"] for t in train} & {t["answer"] for t in heldout}
    assert len({t["question"] for t in heldout}) == len(heldout)
    assert all(t["answer"] in t["question"] for t in train + heldout)
    assert tasks.heldout_tasks() == heldout  # seeded: the same held-out set every run


def test_the_reward_is_the_required_form_only() -> None:
    tasks = _tasks()
    task = {"question": "Repeat this word: lantern. Reply with only that word.", "answer": "lantern"}
    for reply in ("lantern", "Lantern.", ' "lantern" ', "**Lantern**", "lantern\n"):
        assert tasks.reward(task, reply) == 1.0, reply
    for reply in ("The word is lantern.", "lantern lantern", "lanterns", "", None, 'The word "lantern" is repeated.'):
        assert tasks.reward(task, reply) == 0.0, reply


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_shortened_run_trains_the_adapter_and_measures_the_heldout_set(tmp_path: Path) -> None:
    """``lightning-sdk train examples/echo_agent`` with 4 small steps and 24 held-out tasks: records are trained
    (groups with a reward spread), the merged model differs from the base only in the LoRA-targeted attention
    projections, and both held-out evaluations ran exactly the configured 24 tasks."""
    from lightning_sdk.policy import smollm2

    out = tmp_path / "run"
    overrides = {
        "rl.steps": 4,
        "rl.tasks_per_step": 8,
        "rl.samples_per_task": 8,
        # base success ~3-6% per rollout at 0.6 (measured 0%, 3%, 6%, 6% per step): 256 rollouts all failing is
        # ~0.04% likely at 3% (128, at 4 samples, failed once in CI: all 128 rewards 0, nothing to train)
        "rl.temperature": 0.6,
        "rl.workers": 16,
        "rl.target_gain": None,
        "rl.max_wall_s": None,
        "eval.n": 24,
        "eval.workers": 24,
    }
    sets = [a for k, v in overrides.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    proc = subprocess.run(
        [sys.executable, "-c", CLI, "train", str(EXAMPLE), "--output", str(out), *sets],
        cwd=str(ROOT),
        env={**os.environ, "PYTHONPATH": str(ROOT), "LIGHTNING_SDK_LOG_LEVEL": "WARNING"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=840,
    )
    assert proc.returncode == 0, proc.stdout.decode(errors="replace")[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4
    for key in ("eval_before", "eval_after"):
        assert summary[key]["n"] == 24 and summary[key]["succeeded"] == 24, summary[key]
        assert 0.0 <= summary[key]["success_rate"] <= 1.0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert sum(r["records"] for r in rows) > 0, "no group had a reward spread: nothing trained"

    base = load_file(str(smollm2.prepare_smollm2() / "model.safetensors"))
    trained = load_file(str(out / "model" / "model.safetensors"))
    assert set(base) <= set(trained) | {k for k in base if k.startswith("lm_head")}
    changed = {k for k in base if k in trained and not bool((base[k] == trained[k]).all())}
    assert changed, "the trained model equals the base: the adapter did not change"
    targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    assert all(any(t in k for t in targets) for k in changed), sorted(changed)[:8]
    assert any("mlp" in k for k in base) and not any("mlp" in k for k in changed)
