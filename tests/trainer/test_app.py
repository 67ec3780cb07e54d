"""The application layer: one job runner under ``train`` and ``daemon`` (``lightning_sdk/app/job.py``)."""

from __future__ import annotations

import inspect
from pathlib import Path

from lightning_sdk.app import daemon as daemon_job
from lightning_sdk.app import train as train_job
from lightning_sdk.app.job import validation_tasks
from lightning_sdk.trainer.config import load_train_config


def test_both_jobs_warm_start_on_the_same_validation_tasks(tmp_path: Path) -> None:
    """``data.validation`` when given, else the last ``warm_start.validation_tasks`` train tasks, for both jobs (the
    daemon used to take a hard-coded last 64)."""
    (tmp_path / "val.jsonl").write_text('{"q": "v1"}\n{"q": "v2"}\n')
    (tmp_path / "train.toml").write_text('agent = "agent.py:agent"\n[warm_start]\nvalidation_tasks = 3\n')
    train = [{"q": i} for i in range(10)]
    assert validation_tasks(load_train_config(tmp_path), train) == [{"q": 7}, {"q": 8}, {"q": 9}]
    with_file = load_train_config(tmp_path, {"data.validation": "val.jsonl"})
    assert validation_tasks(with_file, train) == [{"q": "v1"}, {"q": "v2"}]
    for job in (train_job.run_training, daemon_job.run_daemon):  # both set up and warm-start through open_job
        source = inspect.getsource(job)
        assert "open_job(" in source and "warm_start(" in source and "train_tasks[-" not in source


def test_one_sampling_override_rule_for_every_engine() -> None:
    """Evaluation and RL sampling replace the request's settings, except ``max_tokens``, which only caps it (the
    rule was written twice, in the embedded engine and in the served-engine wrapper)."""
    from lightning_sdk.engines.base import Sampling

    asked = Sampling(max_tokens=20, temperature=1.0, top_p=0.9)
    assert asked.overridden(None) is asked
    forced = asked.overridden({"temperature": 0.0, "max_tokens": 64})
    assert (forced.temperature, forced.max_tokens, forced.top_p) == (0.0, 20, 0.9)
    assert asked.overridden({"max_tokens": 8}).max_tokens == 8
