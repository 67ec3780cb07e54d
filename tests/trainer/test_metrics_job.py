"""``GET /metrics`` on the trainer daemon's proxy: the job ``lightning-sdk daemon`` runs (``open_job``: SQLite
store, loopback proxy, embedded engine, learner) with the calc example's agent as in-process workers, two real
training steps, then a scrape parsed by prometheus_client's text parser, checked against the store and the loop."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lightning_sdk.agent import load_agent
from lightning_sdk.app.job import open_job
from lightning_sdk.app.rl import RLWorkers
from lightning_sdk.trainer.config import load_train_config
from tests.support.waiting import until_async
from tests.trainer.tiny import build_small_policy, write_config


@pytest.fixture(scope="module")
def small_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_small_policy(tmp_path_factory.mktemp("policy") / "tiny", hidden=32, layers=2)


async def settled_scrape(client: httpx.AsyncClient, deadline_s: float = 60.0) -> httpx.Response:
    """Scrape once no call is being served and the recorder has written everything queued: a call the release cut
    off is still answered and recorded after ``workers.close()`` returns, so a scrape before that would count it
    nowhere yet while the store (read after the scrape) already has it."""
    scraped: list[httpx.Response] = []

    async def settled() -> bool:
        r = await client.get("/metrics")
        scraped.append(r)
        gauges = {
            s.name: s.value
            for family in text_string_to_metric_families(r.text)
            for s in family.samples
            if s.name in ("lightning_sdk_calls_in_flight", "lightning_sdk_recorder_queue_depth")
        }
        return r.status_code != 200 or (len(gauges) == 2 and not any(gauges.values()))

    await until_async(settled, timeout=deadline_s, what="no call in flight or queued on /metrics", every=0.05)
    return scraped[-1]


async def test_daemon_metrics_count_the_steps_and_the_published_version(tmp_path: Path, small_policy: Path) -> None:
    path = write_config(
        tmp_path / "daemon.toml",
        str(small_policy),
        warm_start={"enabled": False},
        rl={"steps": 2, "tasks_per_step": 2, "samples_per_task": 2, "max_tokens": 16, "drop_zero_variance": False},
    )
    config = load_train_config(path)
    async with open_job(config, tmp_path / "run", require_train=True) as job:
        workers = await RLWorkers.start(job.loop, load_agent(config.agent), 4)
        try:
            await job.loop.train_steps(2)
        finally:
            await workers.close()
        await job.loop.flush_weights()
        async with httpx.AsyncClient(base_url=job.server.url) as client:
            r = await settled_scrape(client)
        counts = await job.loop.store.counts()
        served = job.parts.engine.policy_version
        groups, _ = await job.loop.store.list_group_details(split=None, limit=1000)
    calls = [c for g in groups for r in g.rollouts for a in r.attempts for c in a.calls]
    assert r.status_code == 200
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))

    assert job.loop.step == 2
    assert value("lightning_sdk_learner_step_seconds_count") == 2  # both steps trained (no zero-variance drop)
    assert value("lightning_sdk_learner_step_seconds_sum") > 0
    assert value("lightning_sdk_weight_publication_seconds_count") == 2
    assert value("lightning_sdk_staleness_count") == 4  # two groups a step
    assert value("lightning_sdk_policy_version") == served == 2  # read from the engine at scrape
    assert value("lightning_sdk_rollouts", status="succeeded") == counts.get("succeeded", 0) > 0
    # every succeeded attempt ended through the proxy's finish barrier (the workers' finish)
    assert value("lightning_sdk_attempts_ended_total", status="succeeded") >= counts.get("succeeded", 0)
    assert value("lightning_sdk_recorded_total", kind="call") == len(calls) > 0
    # the calls through the daemon's proxy (token mode over the embedded engine): every recorded call counted once,
    # its ids in the token histograms
    assert value("lightning_sdk_calls_total", mode="token") >= len(calls)
    with_ids = [c for c in calls if c.prompt_ids or c.completion_ids]  # a call cut off by the release has none
    assert value("lightning_sdk_call_tokens_count", kind="completion", mode="token") == len(with_ids)
    assert value("lightning_sdk_call_tokens_sum", kind="prompt") == sum(len(c.prompt_ids) for c in calls)
    assert value("lightning_sdk_call_tokens_sum", kind="completion") == sum(len(c.completion_ids) for c in calls)
