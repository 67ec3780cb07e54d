"""Several policies in one run (``[policies.NAME] lora``): a two-role agent calls a planner and a coder, each a LoRA
adapter over one base model, through the real proxy; each call is recorded with the policy that served it and its
version, each policy's records train its own adapter only, advantages per policy from the same rollout reward.

Real parts: the ``lightning-sdk train`` command in a subprocess (SQLite store, proxy on loopback, the embedded engine
serving both adapters unmerged, PEFT learners), the OpenAI SDK in the agent, the tiny policy of
``tests/trainer/tiny.py``.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from lightning_sdk.app.policies import PolicyLearners
from lightning_sdk.errors import ConfigError
from lightning_sdk.policy.model import load_policy
from lightning_sdk.records.record import CallSpan, Record, Segment
from lightning_sdk.trainer.config import load_train_config
from lightning_sdk.trainer.learner import Learner, LearnerConfig, LoraSettings
from tests.trainer.tiny import CLI, ROOT, build_small_policy

HERE = Path(__file__).resolve().parent
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def small_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_small_policy(tmp_path_factory.mktemp("policy") / "tiny", hidden=32, layers=2)


def _config(tmp_path: Path, model: Path, steps: int) -> Path:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"question": f"what is {i} plus {i}?"}) + "\n" for i in range(16)))
    lora = ", ".join(f"{k} = {json.dumps(v)}" for k, v in LORA.items())
    text = f"""
agent = "{HERE / "two_roles.py"}:agent"
threads = 1
[data]
train = "{tasks}"
heldout = "{tasks}"
[eval]
n = 4
max_tokens = 12
workers = 4
[policy]
model = "{model}"
[warm_start]
enabled = false
[rl]
steps = {steps}
tasks_per_step = 2
samples_per_task = 4
workers = 8
max_tokens = 12
drop_zero_variance = false
max_staleness = 4
[learner]
lr = 0.05
balance_threads = false
[policies.planner]
lora = {{{lora}}}
[policies.coder]
lora = {{{lora}}}
"""
    path = tmp_path / "train.toml"
    path.write_text(text)
    return path


def test_a_two_role_agent_trains_one_adapter_per_policy(tmp_path: Path, small_policy: Path) -> None:
    config = _config(tmp_path, small_policy, steps=2)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{HERE}", "LIGHTNING_SDK_LOG_LEVEL": "WARNING"}
    proc = subprocess.run(
        [sys.executable, "-c", CLI, "train", str(config), "--output", str(out)],
        cwd=str(ROOT), env=env, capture_output=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr).decode()[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2

    # every call is recorded under the policy that served it, with that policy's version; the unknown name too
    db = sqlite3.connect(out / "store.db")
    rows = db.execute("SELECT body, length(completion_ids) FROM calls").fetchall()
    calls = [{**json.loads(body), "completion_ids": n} for body, n in rows]
    by_model: dict[str, list[dict[str, object]]] = {}
    for c in calls:
        by_model.setdefault(str(c["model"]), []).append(c)
    assert set(by_model) == {"planner", "coder", "reviewer"}
    refused = by_model["reviewer"]
    assert refused and all(c["error"] and not c["completion_ids"] for c in refused)
    assert all("model_not_found" in str(c["error"]) or "not served" in str(c["error"]) for c in refused)
    for name in ("planner", "coder"):
        served = [c for c in by_model[name] if c["error"] is None]
        # the only failures: calls cut off when the run stopped its workers at the end
        assert all("disconnected" in str(c["error"]) for c in by_model[name] if c["error"] is not None)
        assert len(served) >= 16 and all(c["completion_ids"] for c in served)
        versions = {c["policy_version"] for c in served}
        # each step publishes a new version of both policies (the final evaluation runs on version 2; a version
        # can be passed over when the next one is published before the engine swapped it in)
        assert 0 in versions and max(versions) == 2 and versions <= {0, 1, 2}

    # each step trained both policies, each on its own records
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        metrics = s  # the learner metrics sit in the row
        assert metrics["planner/records"] == metrics["coder/records"] == 8  # one segment per rollout each
        for name in ("planner", "coder"):
            assert metrics[f"{name}/grad_norm"] > 0
            if s["step"] == 1:  # all sampled by version 0, the learners' own start: the engine served each
                # adapter unmerged with its learner's log-probs (later steps train some groups off-policy)
                assert abs(metrics[f"{name}/rollout_kl"]) < 1e-4

    # the saved adapters both moved away from PEFT's start (B = 0) and differ from each other
    model_dir = Path(summary["model_dir"])
    adapters = {
        n: load_file(str(model_dir / "adapters" / n / "adapter_model.safetensors")) for n in ("planner", "coder")
    }
    for state in adapters.values():
        b = [v for k, v in state.items() if "lora_B" in k]
        assert b and all(float(t.abs().max()) > 0 for t in b)
    assert set(adapters["planner"]) == set(adapters["coder"])
    assert any(not torch.equal(adapters["planner"][k], adapters["coder"][k]) for k in adapters["planner"])


def _record(policy: str, seed: int, advantage: float) -> Record:
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 300, 14).astype(np.int64)
    mask = np.zeros(14, dtype=np.int8)
    mask[8:] = 1
    logprobs = np.where(mask == 1, -3.0, 0.0)
    seg = Segment(f"att-{seed}", f"r-{seed}", 0, ids, mask, logprobs, spans=(CallSpan(f"c-{seed}", 0, 8, 14, 0),))
    return Record(seg, "g", advantage, np.where(mask == 1, advantage, 0.0), 1.0, policy)


def test_each_policy_trains_only_on_its_own_records(small_policy: Path) -> None:
    """``PolicyLearners.step`` on records of both policies gives each adapter exactly what a lone learner trained on
    that policy's records alone gives; a policy without records in a step is left as it was."""
    config = LearnerConfig(lr=0.05, lora=LoraSettings(**LORA))  # type: ignore[arg-type]

    def learner(seed: int) -> Learner:
        model, _ = load_policy(small_policy)
        torch.manual_seed(seed)  # the adapter's initial A
        return Learner(model, config)

    records = [_record("planner", 1, 1.0), _record("coder", 2, -1.0), _record("planner", 3, -0.5)]
    both = PolicyLearners({"planner": learner(10), "coder": learner(20)})
    metrics = both.step(records)
    assert metrics["planner/records"] == 2 and metrics["coder/records"] == 1
    alone = {"planner": learner(10), "coder": learner(20)}
    alone["planner"].step([r for r in records if r.policy == "planner"])
    alone["coder"].step([r for r in records if r.policy == "coder"])
    got = both.weights()
    for name, lone in alone.items():
        expected = lone.adapter_weights()
        assert set(got[name]) == set(expected)
        assert all(torch.allclose(got[name][k], expected[k], atol=1e-6) for k in expected), name
    before = {k: v.clone() for k, v in got["coder"].items()}
    both.step([_record("planner", 4, 1.0)])
    after = both.weights()
    assert all(torch.equal(after["coder"][k], before[k]) for k in before)  # no coder records: unchanged
    assert any(not torch.equal(after["planner"][k], got["planner"][k]) for k in before if k in after["planner"])


def test_policies_config_refuses_what_it_cannot_run(tmp_path: Path, small_policy: Path) -> None:
    path = _config(tmp_path, small_policy, steps=1)
    assert list(load_train_config(path).policies) == ["planner", "coder"]
    with pytest.raises(ConfigError, match=r"warm_start.enabled = false"):
        load_train_config(path, {"warm_start.enabled": True})
    with pytest.raises(ConfigError, match=r"backend = 'embedded'"):
        load_train_config(path, {"backend": "verl"})
    with pytest.raises(ConfigError, match=r"no learner.lora"):
        load_train_config(path, {"learner.lora": {"rank": 2}})
