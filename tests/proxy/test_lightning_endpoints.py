"""The ``/lightning/v1`` endpoints of the contract: sessions, reward, finish (the durability barrier), rollouts,
health and the store mounted under the admin key."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai

from lightning_sdk.store import SQLiteStore
from lightning_sdk.types import AttemptStatus, RolloutStatus
from tests.support.mock_openai import EOS_ID, encode
from tests.support.proxy import ProxyHandle

MESSAGES = [{"role": "user", "content": "hi"}]


def test_sessions_need_the_admin_key_and_answer_the_contract_shape(px: ProxyHandle) -> None:
    assert px.http.post("/lightning/v1/sessions", json={}).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert px.http.post("/lightning/v1/sessions", json={}, headers=wrong).json()["error"]["type"] == (
        "authentication_error"
    )
    r = px.http.post("/lightning/v1/sessions", json={"task": {"q": 1}, "group": "g-demo"}, headers=px.admin)
    assert r.status_code == 200
    s = r.json()
    assert set(s) >= {"rollout_id", "attempt_id", "token", "base_url"}
    assert s["base_url"] == f"{px.url}/t/{s['token']}/v1"
    detail = px.rollout(s["rollout_id"])
    assert detail["group"] == "g-demo" and detail["task"] == {"q": 1} and detail["status"] == "running"
    bad = px.http.post("/lightning/v1/sessions", json={"task": [1]}, headers=px.admin)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "task"


def test_reward_finish_and_rollout_detail(px: ProxyHandle) -> None:
    s = px.session({"q": "2+2"})
    client = openai.OpenAI(base_url=px.url + "/v1", api_key=s["token"], max_retries=0)
    client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=3)  # type: ignore[arg-type]

    bad = px.http.post(
        "/lightning/v1/reward", json={"value": "high"}, headers={"Authorization": f"Bearer {s['token']}"}
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "value"
    assert px.reward(s["token"], 0.75).json() == {
        "rollout_id": s["rollout_id"],
        "attempt_id": s["attempt_id"],
        "name": "reward",
        "value": 0.75,
    }
    assert px.reward(s["token"], 1, name="format").status_code == 200
    bad_finish = px.finish(s["token"], status="maybe")
    assert bad_finish.status_code == 400 and bad_finish.json()["error"]["param"] == "status"

    done = px.finish(s["token"])
    assert done.status_code == 200
    answer = done.json()
    assert answer.pop("inflight")["aborted"] == 0
    assert answer == {
        "rollout_id": s["rollout_id"],
        "attempt_id": s["attempt_id"],
        "status": "succeeded",
        "calls": 1,
        "calls_failed": 0,
        "calls_not_recorded": 0,
        "rewards_not_recorded": 0,
    }

    d = px.rollout(s["rollout_id"])
    assert d["rollout_id"] == s["rollout_id"] and d["status"] == "succeeded" and d["task"] == {"q": "2+2"}
    [attempt] = d["attempts"]
    assert attempt["attempt_id"] == s["attempt_id"] and attempt["status"] == "succeeded" and attempt["error"] is None
    [call] = attempt["calls"]
    assert set(call) >= {
        "call_id",
        "model",
        "prompt_ids",
        "completion_ids",
        "logprobs",
        "policy_version",
        "token_source",
        "finish_reason",
    }
    assert call["completion_ids"] == encode("Hel") and call["finish_reason"] == "length"
    assert sorted((w["name"], w["value"], w["call_id"]) for w in d["rewards"]) == [
        ("format", 1.0, None),
        ("reward", 0.75, None),
    ]


def test_failed_finish_records_the_error(px: ProxyHandle) -> None:
    s = px.session()
    assert px.finish(s["token"], status="failed", error="tool crashed").json()["status"] == "failed"
    d = px.rollout(s["rollout_id"])
    assert d["attempts"][0]["status"] == "failed" and d["attempts"][0]["error"] == "tool crashed"
    assert d["status"] == "failed"


def test_reward_and_finish_under_the_path_token(px: ProxyHandle) -> None:
    s = px.session()
    assert px.http.post(f"/t/{s['token']}/lightning/v1/reward", json={"value": 2.0}).status_code == 200
    r = px.http.post(f"/t/{s['token']}/lightning/v1/finish", json={"status": "succeeded"})
    assert r.status_code == 200
    assert px.rollout(s["rollout_id"])["rewards"][0]["value"] == 2.0


def test_list_rollouts_pages_and_filters(px: ProxyHandle) -> None:
    sessions = [px.session({"i": i}) for i in range(3)]
    px.finish(sessions[1]["token"])
    assert px.http.get("/lightning/v1/rollouts").status_code == 401

    first = px.http.get("/lightning/v1/rollouts", params={"limit": 2}, headers=px.admin).json()
    assert [r["rollout_id"] for r in first["rollouts"]] == [s["rollout_id"] for s in sessions[:2]]
    assert set(first["rollouts"][0]) >= {"rollout_id", "status", "group"}
    assert first["next"] is not None
    rest = px.http.get("/lightning/v1/rollouts", params={"limit": 2, "after": first["next"]}, headers=px.admin).json()
    assert [r["rollout_id"] for r in rest["rollouts"]] == [sessions[2]["rollout_id"]]
    assert rest["next"] is None

    done = px.http.get("/lightning/v1/rollouts", params={"status": "succeeded"}, headers=px.admin).json()
    assert [r["rollout_id"] for r in done["rollouts"]] == [sessions[1]["rollout_id"]]
    bad = px.http.get("/lightning/v1/rollouts", params={"status": "nope"}, headers=px.admin)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "status"
    forged = px.http.get("/lightning/v1/rollouts", params={"after": "zzz"}, headers=px.admin)
    assert forged.status_code == 400 and forged.json()["error"]["param"] == "after"
    missing = px.http.get("/lightning/v1/rollouts/ro-missing", headers=px.admin)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_health_needs_no_key_and_store_needs_the_admin_key(px: ProxyHandle) -> None:
    r = px.http.get("/lightning/v1/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert px.http.get("/lightning/v1/store/counts").status_code == 401


def test_finish_is_a_durability_barrier(px: ProxyHandle, tmp_path: Path) -> None:
    """With the recorder told to linger 30 s between batches, only the finish barrier can get the calls written:
    once finish answers, a second connection to the SQLite file sees every call and reward of the attempt."""
    px.app.state.proxy.recorder.linger_s = 30.0
    s = px.session()
    client = openai.OpenAI(base_url=px.url + "/v1", api_key=s["token"], max_retries=0)
    for i in range(5):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": f"q{i}"}])
    px.reward(s["token"], 1.0)
    assert px.finish(s["token"]).json()["calls"] == 5

    async def read() -> tuple[int, int, RolloutStatus, AttemptStatus, list[int]]:
        other = SQLiteStore(tmp_path / "store.db")
        try:
            d = await other.get_rollout(s["rollout_id"])
        finally:
            await other.close()
        a = d.attempts[0]
        return len(a.calls), len(a.rewards), d.rollout.status, a.attempt.status, a.calls[0].completion_ids

    n_calls, n_rewards, rollout_status, attempt_status, ids = asyncio.run(read())
    assert (n_calls, n_rewards) == (5, 1)
    assert rollout_status is RolloutStatus.SUCCEEDED and attempt_status is AttemptStatus.SUCCEEDED
    assert ids == [*encode("Hello from the mock upstream."), EOS_ID]
