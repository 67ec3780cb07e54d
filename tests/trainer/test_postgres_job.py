"""The job ``lightning-sdk daemon`` runs (``open_job``) on a PostgreSQL store: ``[store] url = "postgresql://..."``
(the session's real server, a fresh database), the calc example's agent as in-process workers, two real training
steps (tiny policy, embedded engine and learner, as tests/trainer/test_metrics_job.py does on SQLite). Checked in the
database afterwards through a separate store: every trained group consumed by one of the two steps, the published
policy versions, every recorded call whole (ids and log-probs of equal length, numbered 0..n-1 per attempt), and no
SQLite file in the run directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_sdk.agent import load_agent
from lightning_sdk.app.job import open_job
from lightning_sdk.app.rl import RLWorkers
from lightning_sdk.store.postgres import PostgresStore
from lightning_sdk.trainer.config import load_train_config
from lightning_sdk.types import AttemptStatus, RolloutStatus
from tests.trainer.tiny import build_small_policy, write_config


@pytest.fixture(scope="module")
def small_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_small_policy(tmp_path_factory.mktemp("policy") / "tiny", hidden=32, layers=2)


async def test_the_daemons_job_trains_two_steps_on_a_postgresql_store(
    tmp_path: Path, small_policy: Path, postgres_url: str
) -> None:
    path = write_config(
        tmp_path / "daemon.toml",
        str(small_policy),
        warm_start={"enabled": False},
        store={"url": postgres_url},
        rl={"steps": 2, "tasks_per_step": 2, "samples_per_task": 2, "max_tokens": 16, "drop_zero_variance": False},
    )
    config = load_train_config(path)
    async with open_job(config, tmp_path / "run", require_train=True) as job:
        assert isinstance(job.loop.store, PostgresStore)
        workers = await RLWorkers.start(job.loop, load_agent(config.agent), 4)
        try:
            await job.loop.train_steps(2)
        finally:
            await workers.close()
        await job.loop.flush_weights()
        step = job.loop.step
        served = job.parts.engine.policy_version
    assert step == 2 and served == 2
    assert not list((tmp_path / "run").glob("*.db"))  # the run's store is the database, not a SQLite file

    store = PostgresStore(postgres_url, listen=False)
    try:
        version = await store.current_version()
        groups, _ = await store.list_group_details(split="train", limit=1000)
        counts = await store.counts()
    finally:
        await store.close()
    assert version is not None and version.version == 2
    trained = [g for g in groups if g.group.consumed_step is not None]
    assert {g.group.consumed_step for g in trained} == {1, 2}
    assert len(trained) == 4  # two groups a step (no zero-variance drop)
    for g in trained:
        assert len(g.rollouts) == 2 and all(r.rollout.status in (RolloutStatus.SUCCEEDED, RolloutStatus.FAILED)
                                            for r in g.rollouts)  # fmt: skip
        for r in g.rollouts:
            for a in r.attempts:
                if a.attempt.status is not AttemptStatus.SUCCEEDED:
                    continue
                assert [c.seq for c in a.calls] == list(range(len(a.calls))) and a.calls
                for c in a.calls:
                    assert c.error is None and c.completion_ids
                    assert len(c.completion_ids) == len(c.logprobs) and c.prompt_ids
                    assert c.policy_version is not None and 0 <= c.policy_version <= 2
    assert counts.get("succeeded", 0) >= 4
