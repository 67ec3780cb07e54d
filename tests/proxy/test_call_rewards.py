"""Per-call rewards: every chat/completions response carries ``X-Lightning-Call-Id`` (streamed or not), an agent
reads it with the real ``openai`` client (``with_raw_response``), emits a per-call reward, and the rollout's JSON
ties the reward to that call. Real proxy + mock upstream on loopback, a real SQLite store file."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai

import lightning_sdk.agent as la
from tests.agent.stack import proxy_stack
from tests.support.mock_openai import MockOpenAI
from tests.support.proxy import ProxyHandle

_MSGS = [{"role": "user", "content": "hi"}]


def test_call_id_header_on_every_response_and_per_call_reward(px: ProxyHandle, mock: MockOpenAI) -> None:
    s = px.session({"q": 1})
    client = openai.OpenAI(base_url=px.url + "/v1", api_key=s["token"], max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="policy", messages=_MSGS)  # type: ignore[arg-type]
    first_id = raw.headers["x-lightning-call-id"]
    assert raw.parse().choices[0].message.content == "Hello from the mock upstream."
    with client.chat.completions.with_streaming_response.create(
        model="policy",
        messages=_MSGS,  # type: ignore[arg-type]
        stream=True,
    ) as streamed:
        stream_id = streamed.headers["x-lightning-call-id"]
        assert "".join(c.choices[0].delta.content or "" for c in streamed.parse() if c.choices) == (
            "Hello from the mock upstream."
        )
    legacy = client.completions.with_raw_response.create(model="policy", prompt="abc", max_tokens=4)
    legacy_id = legacy.headers["x-lightning-call-id"]
    mock.fail_first, mock.fail_status = 1, 400  # an upstream error is a recorded (failed) call: it has an id too
    failed = httpx.post(
        px.url + "/v1/chat/completions",
        json={"model": "policy", "messages": _MSGS},
        headers={"Authorization": f"Bearer {s['token']}"},
    )
    assert failed.status_code == 400 and failed.headers["x-lightning-call-id"].startswith("call-")
    assert len({first_id, stream_id, legacy_id, failed.headers["x-lightning-call-id"]}) == 4

    assert px.reward(s["token"], 0.5, name="step", call_id=stream_id).json()["call_id"] == stream_id
    unknown = px.reward(s["token"], 1.0, call_id="call-nope")
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "call_id"
    other = px.session({"q": 2})  # a real call id, but of another attempt
    other_client = openai.OpenAI(base_url=px.url + "/v1", api_key=other["token"], max_retries=0)
    other_id = other_client.chat.completions.with_raw_response.create(
        model="policy",
        messages=_MSGS,  # type: ignore[arg-type]
    ).headers["x-lightning-call-id"]
    foreign = px.reward(s["token"], 1.0, call_id=other_id)
    assert foreign.status_code == 400 and "call_id" in foreign.json()["error"]["message"]
    assert px.finish(s["token"]).status_code == 200

    detail = px.rollout(s["rollout_id"])
    calls = detail["attempts"][0]["calls"]
    assert {c["call_id"] for c in calls} == {first_id, stream_id, legacy_id, failed.headers["x-lightning-call-id"]}
    assert [(w["name"], w["value"], w["call_id"]) for w in detail["rewards"]] == [("step", 0.5, stream_id)]


async def test_agent_reads_the_header_and_emits_a_per_call_reward(tmp_path: Path) -> None:
    """The agent side end to end: ``@rollout`` agent run by ``run_tasks`` (worker posts its rewards)."""

    @la.rollout
    async def agent(task: dict[str, str], llm: la.LLM) -> float:
        client = llm.async_openai_client()
        ids = []
        for turn in range(2):
            raw = await client.chat.completions.with_raw_response.create(
                model=llm.model,
                messages=[{"role": "user", "content": f"{task['q']} {turn}"}],
            )
            ids.append(raw.headers["x-lightning-call-id"])
        la.emit_reward(0.25, name="tool_ok", call_id=ids[1])
        return 1.0

    async with proxy_stack(tmp_path) as st:
        summary = await la.run_tasks(agent, st.store, st.url, [{"q": "question"}], n_workers=1)
        assert summary.succeeded == 1
        rollout_id = summary.rollouts[0].rollout_id
        async with httpx.AsyncClient(base_url=st.url) as http:
            r = await http.get(
                f"/lightning/v1/rollouts/{rollout_id}", headers={"Authorization": f"Bearer {st.admin_key}"}
            )
        detail = r.json()
    (attempt,) = detail["attempts"]
    assert attempt["status"] == "succeeded"
    second = next(c["call_id"] for c in attempt["calls"] if c["seq"] == 1)
    rewards = sorted((w["name"], w["value"], w["call_id"]) for w in detail["rewards"])
    assert rewards == [("reward", 1.0, None), ("tool_ok", 0.25, second)]


async def test_a_refused_per_call_reward_fails_the_attempt_with_the_reason(tmp_path: Path) -> None:
    """A reward the proxy refuses (unknown call id) is never dropped silently: the worker finishes the attempt as
    failed at once, with the proxy's reason, instead of leaving it running until its lease expires."""

    @la.rollout
    async def agent(task: dict[str, str], llm: la.LLM) -> float:
        await llm.async_openai_client().chat.completions.create(model=llm.model, messages=_MSGS)  # type: ignore[arg-type]
        la.emit_reward(0.5, name="step", call_id="call-does-not-exist")
        return 1.0

    async with proxy_stack(tmp_path) as st:
        summary = await la.run_tasks(agent, st.store, st.url, [{"q": "question"}], n_workers=1)
        (result,) = summary.rollouts
        detail = await st.store.get_rollout(result.rollout_id)
    assert summary.succeeded == 0
    (attempt,) = detail.attempts
    assert attempt.attempt.status.value == "failed"
    assert "call_id" in (attempt.attempt.error or "") and "call-does-not-exist" in (attempt.attempt.error or "")
