"""The application layer: one job runner under ``train`` and ``daemon`` (``lightning_sdk/app/job.py``)."""

from __future__ import annotations

import inspect
from pathlib import Path

from lightning_sdk.app import daemon as daemon_job
from lightning_sdk.app import train as train_job
from lightning_sdk.app.job import split_sampling
from lightning_sdk.app.loop import records_config
from lightning_sdk.trainer.config import load_train_config
from lightning_sdk.trainer.data import load_tasks


def test_both_jobs_warm_start_on_the_same_validation_tasks(tmp_path: Path) -> None:
    """``data.validation`` when given, else the last ``warm_start.validation_tasks`` train tasks, for both jobs (the
    daemon used to take a hard-coded last 64)."""
    (tmp_path / "val.jsonl").write_text('{"q": "v1"}\n{"q": "v2"}\n')
    (tmp_path / "train.jsonl").write_text("".join(f'{{"q": {i}}}\n' for i in range(10)))
    (tmp_path / "train.toml").write_text(
        'agent = "agent.py:agent"\n[data]\ntrain = "train.jsonl"\n[warm_start]\nvalidation_tasks = 3\n'
    )
    config = load_train_config(tmp_path)
    tail = config.warm_start.validation_tasks
    assert load_tasks(config.data, validation_tail=tail).validation == [{"q": 7}, {"q": 8}, {"q": 9}]
    with_file = load_train_config(tmp_path, {"data.validation": "val.jsonl"})
    assert load_tasks(with_file.data, validation_tail=tail).validation == [{"q": "v1"}, {"q": "v2"}]
    assert load_tasks(with_file.data).validation == []  # no warm start: the validation set is not read
    for job in (train_job.run_training, daemon_job.run_daemon):  # both set up and warm-start through open_job
        source = inspect.getsource(job)
        assert "open_job(" in source and "run_warm_start(" in source and "train_tasks[-" not in source


def test_one_sampling_override_rule_for_every_engine() -> None:
    """Evaluation and RL sampling replace the request's settings, except ``max_tokens``, which only caps it (the
    rule was written twice, in the embedded engine and in the served-engine wrapper)."""
    from lightning_sdk.engines.base import Sampling

    asked = Sampling(max_tokens=20, temperature=1.0, top_p=0.9)
    assert asked.overridden(None) is asked
    forced = asked.overridden({"temperature": 0.0, "max_tokens": 64})
    assert (forced.temperature, forced.max_tokens, forced.top_p) == (0.0, 20, 0.9)
    assert asked.overridden({"max_tokens": 8}).max_tokens == 8


def test_the_jobs_sampling_is_a_rule_per_split(tmp_path: Path) -> None:
    """The trainer hands the proxy one rule per split (``app.job.split_sampling``): train rollouts at ``[rl]``
    settings, every evaluation split (held-out before/checks/after, the warm start's) at ``[eval]`` settings, other
    splits as asked; the trainer never sets anything on the engine."""
    (tmp_path / "train.toml").write_text(
        'agent = "agent.py:agent"\n[rl]\ntemperature = 0.8\nmax_tokens = 40\n[eval]\nmax_tokens = 12\n'
    )
    config = load_train_config(tmp_path)
    rules = split_sampling(config.rl, config.eval)
    assert rules.override_for("train") == {"temperature": 0.8, "top_p": 1.0, "max_tokens": 40}
    for split in ("eval-before", "eval-check-2", "eval-after", "warmup-3"):
        assert rules.override_for(split) == {"temperature": 0.0, "max_tokens": 12}, split
    assert rules.override_for("traced") is None


def test_trained_rows_never_exceed_the_engines_context(tmp_path: Path) -> None:
    """The trainer's records config cuts segments at the engine's ``max_model_len`` (flagged ``truncated``), so a
    row longer than the context is never trained; an engine that does not tell its context leaves rows whole."""
    from lightning_sdk.records import build_records
    from lightning_sdk.types import (
        Attempt,
        AttemptDetail,
        AttemptStatus,
        Call,
        FinishedGroup,
        Group,
        Reward,
        Rollout,
        RolloutDetail,
    )

    (tmp_path / "train.toml").write_text('agent = "agent.py:agent"\n')
    config = load_train_config(tmp_path).rl
    assert records_config(config, 16).merge.max_length == 16
    assert records_config(config, None).merge.max_length is None

    details = []
    for i, reward in enumerate((0.0, 1.0)):
        rid, aid = f"r{i}", f"r{i}-a"
        call = Call(call_id=f"{aid}-0", attempt_id=aid, rollout_id=rid, seq=0, model="policy",
                    prompt_ids=list(range(12)), completion_ids=list(range(100, 110)), logprobs=[-0.5] * 10)  # fmt: skip
        att = Attempt(attempt_id=aid, rollout_id=rid, index=0, token=aid, status=AttemptStatus.SUCCEEDED)
        rew = [Reward(rollout_id=rid, attempt_id=aid, value=reward)]
        ro = Rollout(rollout_id=rid, group_id="g", task={})
        details.append(RolloutDetail(rollout=ro, attempts=[AttemptDetail(attempt=att, calls=[call], rewards=rew)]))
    group = [FinishedGroup(Group(group_id="g", task={}, n=2), details)]
    cut = build_records(group, records_config(config, 16))
    assert cut.records and all(len(r.input_ids) == 16 and r.segment.truncated for r in cut.records)
    whole = build_records(group, records_config(config, None))
    assert all(len(r.input_ids) == 22 and not r.segment.truncated for r in whole.records)


def test_turn_baseline_goes_from_the_rl_section_to_the_records(tmp_path: Path) -> None:
    """``[rl] turn_baseline`` reaches the loop's advantage settings; a value outside group/turn fails at load time."""
    import pytest

    from lightning_sdk.errors import ConfigError

    (tmp_path / "train.toml").write_text('agent = "agent.py:agent"\n')
    assert records_config(load_train_config(tmp_path).rl, None).advantage.turn_baseline == "group"
    turn = load_train_config(tmp_path, {"rl.turn_baseline": "turn"})
    assert records_config(turn.rl, None).advantage.turn_baseline == "turn"
    with pytest.raises(ConfigError, match="turn_baseline"):
        load_train_config(tmp_path, {"rl.turn_baseline": "call"})


def test_groups_of_one_are_trained_only_when_configured(tmp_path: Path) -> None:
    """``[rl] train_single_groups`` (off by default) decides whether the trainer trains groups of one rollout;
    ``samples_per_task = 1`` without it is a config error naming the key, not a run that silently trains nothing."""
    import pytest

    from lightning_sdk.errors import ConfigError

    (tmp_path / "train.toml").write_text('agent = "agent.py:agent"\n')
    assert records_config(load_train_config(tmp_path).rl, None).advantage.train_single_groups is False
    on = load_train_config(tmp_path, {"rl.train_single_groups": "true"})
    assert records_config(on.rl, None).advantage.train_single_groups is True
    with pytest.raises(ConfigError, match="train_single_groups"):
        load_train_config(tmp_path, {"rl.samples_per_task": "1"})
    one = load_train_config(tmp_path, {"rl.samples_per_task": "1", "rl.train_single_groups": "true"})
    assert one.rl.samples_per_task == 1


def test_the_config_is_settled_once_when_loaded(tmp_path: Path) -> None:
    """Every path and ``FILE.py:NAME`` reference is absolute once the config is loaded (relative to the file's
    directory), ``module:NAME`` agents stay importable by name, and ``[learner]`` / ``[verl]`` carry the sampling
    temperature: the parts are handed their sections as they are. Settling a settled config changes nothing (the
    run directory's ``config.json`` reads back the same)."""
    from lightning_sdk.trainer.config import TrainConfig

    model = tmp_path / "hf"
    (tmp_path / "train.toml").write_text(
        'agent = "agent.py:agent"\n[data]\ntrain = "tasks.py:train"\nheldout = "held.jsonl"\n'
        'demonstrations = "sub/demos.jsonl"\n[policy]\nmodel = "hf"\n[rl]\ntemperature = 0.6\n'
        '[engine]\nkind = "vllm"\nlaunch = true\nmodel_path = "served"\n'
    )
    config = load_train_config(tmp_path)
    assert config.agent == f"{tmp_path}/agent.py:agent"
    assert (config.data.train, config.data.heldout) == (f"{tmp_path}/tasks.py:train", f"{tmp_path}/held.jsonl")
    assert config.data.demonstrations == f"{tmp_path}/sub/demos.jsonl" and config.data.validation is None
    assert config.policy.model == str(model) and config.engine.model_path == f"{tmp_path}/served"
    assert config.learner.temperature == 0.6
    assert TrainConfig.model_validate_json(config.model_dump_json()) == config
    by_name = load_train_config(tmp_path, {"agent": "my_pkg.agents:solver", "policy.model": "tiny"})
    assert by_name.agent == "my_pkg.agents:solver" and by_name.policy.model == "tiny"
    verl = load_train_config(tmp_path, {"backend": "verl", "engine.kind": "embedded", "engine.launch": "false",
                                        "engine.model_path": "null"})  # fmt: skip
    assert verl.verl is not None and verl.verl.temperature == 0.6  # [verl] made when backend = "verl"
