"""``GET /metrics`` on the tracing proxy: a real proxy on loopback in front of the mock engine (vLLM wire format),
a real SQLite store, real calls through the ``openai`` client, then a scrape parsed by prometheus_client's own text
parser; the values are checked against what the store recorded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from lightning_sdk.monitoring import OpsMetrics
from lightning_sdk.proxy import ProxyConfig
from tests.support.proxy import ProxyHandle, run_proxy
from tests.support.servers import RunningServer


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``GET url/metrics`` without a key, parsed: {(sample name, sorted labels): value}."""
    r = httpx.get(url + "/metrics", timeout=10.0)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def _calls(px: ProxyHandle, n: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    s = px.session({"q": 1})
    client = openai.OpenAI(base_url=px.url + "/v1", api_key=s["token"], max_retries=0)
    for i in range(n):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": f"add {i} and 2"}])
    assert px.reward(s["token"], 1.0).status_code == 200
    assert px.finish(s["token"]).status_code == 200
    return s, px.calls(s["rollout_id"])


def test_metrics_after_real_calls_match_the_store(upstream: RunningServer, tmp_path: Path) -> None:
    with run_proxy(upstream.url + "/v1", store_path=tmp_path / "store.db") as px:
        before = scrape(px.url)
        assert value(before, "lightning_sdk_recorded_total", kind="call") == 0
        _, calls = _calls(px, 3)
        assert len(calls) == 3
        bad = httpx.post(
            px.url + "/v1/chat/completions",
            json={"model": "policy", "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": "Bearer not-a-token"},
        )
        assert bad.status_code == 401
        m = scrape(px.url)
    # the calls: each answered one counted once, with its mode; the refused one under its status, mode none;
    # the token histograms' sums are the recorded ids' lengths
    assert value(m, "lightning_sdk_calls_total", route="chat.completions", status="200", mode="passthrough") == 3
    assert value(m, "lightning_sdk_calls_total", route="chat.completions", status="401", mode="none") == 1
    assert value(m, "lightning_sdk_calls_total") == 4
    assert value(m, "lightning_sdk_call_duration_seconds_count", route="chat.completions") == 4
    assert value(m, "lightning_sdk_call_duration_seconds_sum") > 0
    assert value(m, "lightning_sdk_call_tokens_count", kind="prompt") == 3
    assert value(m, "lightning_sdk_call_tokens_sum", kind="prompt") == sum(len(c["prompt_ids"]) for c in calls)
    assert value(m, "lightning_sdk_call_tokens_sum", kind="completion") == sum(len(c["completion_ids"]) for c in calls)
    assert value(m, "lightning_sdk_calls_in_flight") == 0
    # the recorder: every call and the reward committed, nothing queued, one write latency per batch
    assert value(m, "lightning_sdk_recorded_total", kind="call") == 3
    assert value(m, "lightning_sdk_recorded_total", kind="reward") == 1
    assert value(m, "lightning_sdk_recorder_queue_depth") == 0
    batches = value(m, "lightning_sdk_record_write_seconds_count")
    assert 1 <= batches <= 4  # calls and reward share batches when they arrive within the linger
    assert value(m, "lightning_sdk_record_write_seconds_sum") > 0
    assert value(m, "lightning_sdk_store_errors_total") == 0
    # attempts and rollouts: the finish went through this proxy's barrier; the store's counts at scrape
    assert value(m, "lightning_sdk_attempts_ended_total", status="succeeded") == 1
    assert value(m, "lightning_sdk_rollouts", status="succeeded") == 1
    assert value(m, "lightning_sdk_policy_version") == 0  # nothing published: the initial weights


def test_each_app_has_its_own_registry_and_metrics_can_be_off(upstream: RunningServer, tmp_path: Path) -> None:
    """Two proxies in one process count apart (no process-global registry); ``ProxyConfig(metrics=False)`` serves no
    ``/metrics`` (404 in the OpenAI error shape)."""
    with (
        run_proxy(upstream.url + "/v1", store_path=tmp_path / "a.db") as a,
        run_proxy(upstream.url + "/v1", store_path=tmp_path / "b.db") as b,
    ):
        _calls(a, 2)
        assert value(scrape(a.url), "lightning_sdk_recorded_total", kind="call") == 2
        assert value(scrape(b.url), "lightning_sdk_recorded_total", kind="call") == 0
    with run_proxy(upstream.url + "/v1", store_path=tmp_path / "c.db", config=ProxyConfig(metrics=False)) as off:
        r = httpx.get(off.url + "/metrics")
        assert r.status_code == 404 and "error" in r.json()
        assert off.app.state.proxy.metrics is None


async def test_a_failing_scrape_read_is_counted_and_the_scrape_still_answers() -> None:
    """A refresher that raises (the store down at scrape time) counts ``store_errors_total{op="scrape"}``; the text
    still carries the other families."""
    metrics = OpsMetrics()

    async def broken() -> None:
        raise OSError("store is down")

    metrics.refreshers.append(broken)
    metrics.attempt_ended("failed")
    text = (await metrics.render()).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert value(samples, "lightning_sdk_store_errors_total", op="scrape") == 1
    assert value(samples, "lightning_sdk_attempts_ended_total", status="failed") == 1


async def test_store_errors_count_a_lost_call_and_not_the_good_one(tmp_path: Path) -> None:
    """A real SQLite store refuses a call of an attempt it does not know: the batch fails (``record_batch``), the
    items are retried one by one, the bad one is lost (``record_item``) and the good one still counts as written."""
    from lightning_sdk.proxy._recorder import Recorder
    from lightning_sdk.store import SQLiteStore
    from lightning_sdk.types import Call

    store = SQLiteStore(tmp_path / "store.db")
    try:
        claim = await store.open_session({"q": 1})
        metrics = OpsMetrics()
        recorder = Recorder(store, metrics=metrics, linger_s=0.0, retries=0)

        def call(attempt_id: str, rollout_id: str) -> Call:
            return Call(
                call_id=f"{attempt_id}-0", attempt_id=attempt_id, rollout_id=rollout_id, seq=0, model="policy",
                prompt_ids=[1, 2], completion_ids=[3], logprobs=[-0.1],
            )  # fmt: skip

        await recorder.add_call(call("no-such-attempt", claim.rollout.rollout_id))
        await recorder.add_call(call(claim.attempt.attempt_id, claim.rollout.rollout_id))
        await recorder.drain()
        assert await recorder.commit("no-such-attempt")  # what was lost is reported to the barrier
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families((await metrics.render()).decode())
            for s in f.samples
        }
        assert value(samples, "lightning_sdk_store_errors_total", op="record_item") == 1
        assert value(samples, "lightning_sdk_store_errors_total", op="record_batch") >= 1
        assert value(samples, "lightning_sdk_recorded_total", kind="call") == 1
        await recorder.stop()
    finally:
        await store.close()
