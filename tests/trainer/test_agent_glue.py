"""The agent-side pieces the trainer relies on: the public ``import_path`` (task generators named ``FILE.py:NAME``)
and the worker's heartbeat/finish race being benign (a debug line, not a warning).

The race test runs a real proxy app on loopback over a real SQLite store; the only wrapper holds the worker's
heartbeat back until the attempt has finished, to make the race happen every time instead of by chance.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

import lightning_sdk.agent as la
from lightning_sdk.errors import ConfigError
from lightning_sdk.trainer.config import TrainConfig
from lightning_sdk.trainer.data import load_rows
from tests.agent.stack import proxy_stack
from tests.support.waiting import until_async


def test_import_path_is_public_and_feeds_load_rows(tmp_path: Path) -> None:
    (tmp_path / "helper.py").write_text("BASE = 40\n")
    (tmp_path / "gen.py").write_text("from helper import BASE\ndef rows():\n    return [{'x': BASE + 2}]\n")
    module = la.import_path(tmp_path / "gen.py")
    assert module.rows() == [{"x": 42}]
    assert la.import_path(str(tmp_path / "gen.py")) is module  # imported once per path
    config = TrainConfig(agent="a.py:agent", base_dir=tmp_path, data={"train": "gen.py:rows"})
    assert config.data.train == f"{tmp_path}/gen.py:rows"  # resolved once, when the config is built
    assert load_rows(config.data.train, "data.train") == [{"x": 42}]
    with pytest.raises(ConfigError, match=r"data.train: no file .*missing.py"):
        load_rows(f"{tmp_path}/missing.py:rows", "data.train")
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        load_rows(f"{tmp_path}/gen.py:nope", "data.train")


class _LateHeartbeat:
    """The real store, except that the first heartbeat of the "quick" task is delivered only after that attempt has
    finished (the race); a slow second task keeps the pool, and so its heartbeat loop, running meanwhile."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.late: list[str] = []
        self.holding = asyncio.Event()  # the quick attempt's heartbeat is held: its agent may finish now
        self.delivered = asyncio.Event()  # the held heartbeat went out after the finish: the slow agent may end

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def heartbeat(self, attempt_id: str, *, lease_s: float = 60.0) -> Any:
        attempt = await self._store.get_attempt(attempt_id)
        detail = await self._store.get_rollout(attempt.rollout_id)
        if detail.rollout.task.get("q") == "quick" and not self.late:
            self.late.append(attempt_id)
            self.holding.set()

            async def finished() -> bool:
                return (await self._store.get_attempt(attempt_id)).status.value != "running"

            try:
                await until_async(finished, timeout=30, what="the quick attempt's finish")
                return await self._store.heartbeat(attempt_id, lease_s=lease_s)
            finally:
                self.delivered.set()
        return await self._store.heartbeat(attempt_id, lease_s=lease_s)


async def test_heartbeat_racing_the_finish_is_not_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    @la.rollout
    async def agent(task: dict[str, str], llm: la.LLM) -> float:
        # the quick one ends while its heartbeat is held; the slow one keeps the pool alive until it went out
        await (store.holding if task["q"] == "quick" else store.delivered).wait()
        return 1.0

    caplog.set_level(logging.DEBUG, logger="lightning_sdk.agent.worker")
    async with proxy_stack(tmp_path) as st:
        store = _LateHeartbeat(st.store)
        tasks = [{"q": "quick"}, {"q": "slow"}]
        summary = await la.run_tasks(agent, store, st.url, tasks, n_workers=2, lease_s=5.0, heartbeat_s=0.05)
    assert summary.succeeded == 2
    assert store.late, "the heartbeat never raced the finish"
    worker_records = [r for r in caplog.records if r.name == "lightning_sdk.agent.worker"]
    assert not [r for r in worker_records if r.levelno >= logging.WARNING], [r.getMessage() for r in worker_records]
    assert any("raced its finish" in r.getMessage() for r in worker_records if r.levelno == logging.DEBUG)


async def test_train_rollouts_get_the_agents_max_attempts(tmp_path: Path) -> None:
    """``lightning-sdk train`` enqueues train rollouts with the agent's ``max_attempts`` (a crashed harness is retried,
    its failed attempt never trained), not the store's default of one try."""
    import sqlite3

    from lightning_sdk.app.loop import TrainingLoop
    from lightning_sdk.app.parts import build_parts
    from lightning_sdk.store import open_store
    from lightning_sdk.trainer.config import load_train_config
    from tests.trainer.tiny import build_small_policy, write_config

    model = build_small_policy(tmp_path / "policy", hidden=32, layers=2)
    config = load_train_config(write_config(tmp_path / "train.toml", str(model), rl={"tasks_per_step": 2}))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    parts = build_parts(run_dir, model, engine=config.engine, learner=config.learner)
    tasks = [{"question": "1+1", "answer": "2"}] * 4
    loop = TrainingLoop.configured(open_store(run_dir / "store.db"), parts, run_dir, config.rl, train_tasks=tasks,
                                   max_attempts=3)  # fmt: skip
    try:
        await loop.feed()
    finally:
        await parts.close()
        await loop.store.close()
    db = sqlite3.connect(run_dir / "store.db")
    rows = db.execute("SELECT split, max_attempts, COUNT(*) FROM rollouts GROUP BY 1, 2").fetchall()
    assert rows == [("train", 3, 4 * config.rl.samples_per_task)]
