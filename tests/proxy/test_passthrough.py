"""The real ``openai`` client (sync, async, streaming, tools) through the proxy to a loopback engine that speaks
vLLM's ``return_token_ids`` wire format; asserts exactly what lands in the store."""

from __future__ import annotations

import json
from typing import Any

import openai

from lightning_sdk.types import PolicyVersion
from tests.support.mock_openai import EOS_ID, MockOpenAI, MockReply, encode, logprob_of, render_prompt
from tests.support.proxy import ProxyHandle

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    }
]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
REPLY = "Hello from the mock upstream."


def _strip_volatile(call: dict[str, Any]) -> dict[str, Any]:
    """A call without what differs between two identical calls (ids, order, timings)."""
    out = {k: v for k, v in call.items() if k not in ("call_id", "seq", "started_at", "ended_at")}
    out["response"] = {k: v for k, v in call["response"].items() if k not in ("id", "created")}
    return out


def test_sync_chat_records_exact_engine_ids(px: ProxyHandle, mock: MockOpenAI) -> None:
    px.call(px.store.publish_version(PolicyVersion(version=7, step=3)))
    s = px.session({"question": "2+2"})
    client = openai.OpenAI(base_url=px.url + "/v1", api_key=s["token"], max_retries=0)

    resp = client.chat.completions.create(model="policy", messages=MESSAGES, temperature=0.5)

    assert resp.choices[0].message.content == REPLY
    assert resp.choices[0].finish_reason == "stop"
    # what the agent did not ask for is not in its response
    assert "prompt_token_ids" not in (resp.model_extra or {})
    assert "token_ids" not in (resp.choices[0].model_extra or {})
    assert resp.choices[0].logprobs is None
    # what the proxy asked the engine for
    sent = mock.requests[-1]
    assert sent["return_token_ids"] is True and sent["logprobs"] is True
    assert "Authorization" not in sent and mock.headers[-1].get("authorization") is None  # the token stays here

    [call] = px.calls(s["rollout_id"])
    prompt_ids = encode(render_prompt(MESSAGES))
    completion_ids = [*encode(REPLY), EOS_ID]
    assert call["prompt_ids"] == prompt_ids
    assert call["completion_ids"] == completion_ids
    assert call["logprobs"] == [logprob_of(i) for i in range(len(completion_ids))]
    assert call["policy_version"] == 7
    assert call["finish_reason"] == "stop"
    assert call["token_source"] == "engine"
    assert call["is_policy"] is True
    assert call["seq"] == 0
    assert call["checks"] == {}
    assert call["error"] is None
    assert call["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(completion_ids),
        "total_tokens": len(prompt_ids) + len(completion_ids),
    }
    assert call["request"] == {"model": "policy", "messages": MESSAGES, "temperature": 0.5}
    assert call["response"]["choices"][0]["message"] == {"role": "assistant", "content": REPLY}
    assert call["attempt_id"] == s["attempt_id"] and call["rollout_id"] == s["rollout_id"]


async def test_async_stream_records_what_the_unstreamed_call_records(px: ProxyHandle, mock: MockOpenAI) -> None:
    s = px.session()
    client = openai.AsyncOpenAI(base_url=px.url + "/v1", api_key=s["token"], max_retries=0)

    plain = await client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=12)
    stream = await client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=12, stream=True)
    pieces = []
    finish = None
    async for chunk in stream:
        assert "token_ids" not in (chunk.choices[0].model_extra or {}) if chunk.choices else True
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        assert chunk.usage is None  # the agent did not ask for usage; the proxy did (for the record)
    await client.close()

    assert "".join(pieces) == plain.choices[0].message.content == REPLY[:12]
    assert finish == plain.choices[0].finish_reason == "length"
    assert mock.requests[-1]["stream_options"] == {"include_usage": True}
    first, second = px.calls(s["rollout_id"])
    assert (first["seq"], second["seq"]) == (0, 1)
    assert len(first["completion_ids"]) == 12
    assert _strip_volatile(first) == _strip_volatile(second)


def test_tools_round_trip_streamed_and_not(px: ProxyHandle) -> None:
    s = px.session()
    client = openai.OpenAI(base_url=px.url + "/v1", api_key=s["token"], max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "define entropy"}]

    first = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    [tc] = first.choices[0].message.tool_calls or []
    assert first.choices[0].finish_reason == "tool_calls"
    assert tc.function.name == "lookup" and json.loads(tc.function.arguments) == {"query": "define entropy"}

    streamed = client.chat.completions.create(
        model="policy",
        messages=messages,
        tools=TOOLS,  # type: ignore[arg-type]
        stream=True,
    )
    streamed_calls = [d.tool_calls for c in streamed if c.choices for d in [c.choices[0].delta] if d.tool_calls]
    assert streamed_calls[0][0].function.arguments == tc.function.arguments

    messages += [
        {"role": "assistant", "content": None, "tool_calls": [tc.model_dump()]},
        {"role": "tool", "tool_call_id": tc.id, "content": "a measure of disorder"},
    ]
    final = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    assert final.choices[0].message.content == "The tool said: a measure of disorder"

    calls = px.calls(s["rollout_id"])
    assert [c["seq"] for c in calls] == [0, 1, 2]
    assert [c["finish_reason"] for c in calls] == ["tool_calls", "tool_calls", "stop"]
    reply = MockReply(tool_calls=[{"name": "lookup", "arguments": tc.function.arguments}])
    assert calls[0]["completion_ids"] == [*encode(reply.completion_text()), EOS_ID]
    assert calls[0]["response"]["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "lookup"
    assert _strip_volatile(calls[0]) == _strip_volatile(calls[1])
    assert calls[2]["prompt_ids"] == encode(render_prompt(messages))
    assert calls[2]["request"]["tools"] == TOOLS


def test_agent_that_asks_for_ids_and_logprobs_gets_them(px: ProxyHandle) -> None:
    s = px.session()
    client = openai.OpenAI(base_url=px.url + "/v1", api_key=s["token"], max_retries=0)
    resp = client.chat.completions.create(
        model="policy", messages=MESSAGES, logprobs=True, extra_body={"return_token_ids": True}
    )
    extra = resp.model_extra or {}
    assert extra["prompt_token_ids"] == encode(render_prompt(MESSAGES))
    assert (resp.choices[0].model_extra or {})["token_ids"] == [*encode(REPLY), EOS_ID]
    assert [t.logprob for t in resp.choices[0].logprobs.content or []] == [  # type: ignore[union-attr]
        logprob_of(i) for i in range(len(REPLY) + 1)
    ]
    [call] = px.calls(s["rollout_id"])
    assert call["request"]["return_token_ids"] is True
    assert call["completion_ids"] == [*encode(REPLY), EOS_ID]


def test_completions_with_a_token_id_prompt(px: ProxyHandle) -> None:
    s = px.session()
    client = openai.OpenAI(base_url=px.url + "/v1", api_key=s["token"], max_retries=0)
    resp = client.completions.create(model="policy", prompt=[11, 12, 13], max_tokens=5)
    assert resp.choices[0].text == REPLY[:5]
    streamed = client.completions.create(model="policy", prompt=[11, 12, 13], max_tokens=5, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == REPLY[:5]
    first, second = px.calls(s["rollout_id"])
    assert first["prompt_ids"] == [11, 12, 13]
    assert first["completion_ids"] == encode(REPLY[:5])
    assert first["logprobs"] == [logprob_of(i) for i in range(5)]
    assert first["finish_reason"] == "length"
    assert _strip_volatile(first) == _strip_volatile(second)


def test_engine_without_token_ids_is_flagged_not_trusted(px: ProxyHandle, mock: MockOpenAI) -> None:
    mock.supports_token_ids = False
    s = px.session()
    client = openai.OpenAI(base_url=px.url + "/v1", api_key=s["token"], max_retries=0)
    client.chat.completions.create(model="policy", messages=MESSAGES)
    [call] = px.calls(s["rollout_id"])
    assert call["prompt_ids"] == [] and call["completion_ids"] == []
    assert call["checks"] == {"missing_token_ids": True}
    assert call["token_source"] == "text_only"  # nothing retokenized it


def test_models_lists_the_upstream_models(px: ProxyHandle) -> None:
    r = px.http.get("/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == ["policy"]


def test_calls_before_any_publication_record_policy_version_zero(px: ProxyHandle, mock: MockOpenAI) -> None:
    """Tracing without a trainer: the weights being served are the initial ones, so every call records version 0
    (never null: the contract says every call records the version that served it)."""
    s = px.session()
    client = openai.OpenAI(base_url=px.url + "/v1", api_key=s["token"], max_retries=0)
    client.chat.completions.create(model="policy", messages=MESSAGES)  # type: ignore[arg-type]
    [call] = px.calls(s["rollout_id"])
    assert call["policy_version"] == 0


def test_passthrough_keeps_an_attempts_calls_in_memory_only_once_they_are_read(px: ProxyHandle) -> None:
    """The passthrough never reads earlier calls, so the proxy keeps none in memory (a long attempt would make the
    garbage collector walk all of them again and again); the first read of them (here the attempt's calls route,
    right after the last answer, while the recorder still holds the calls) waits for the recorder to commit them
    and reads them from the store, and the calls after it are kept as before."""
    s = px.session({"q": "kept"})
    headers = {"Authorization": f"Bearer {s['token']}"}
    chat = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}

    def one_call() -> str:
        r = px.http.post("/v1/chat/completions", json=chat, headers=headers)
        assert r.status_code == 200
        return str(r.headers["x-lightning-call-id"])

    ids = [one_call() for _ in range(3)]
    state = px.app.proxy.attempts.state_of(s["attempt_id"])
    assert state is not None and state.calls == [] and not state.keep
    listed = px.http.get("/lightning/v1/calls", headers=headers).json()["calls"]
    assert [(c["call_id"], c["seq"]) for c in listed] == [(i, n) for n, i in enumerate(ids)]
    assert [c["completion_ids"][-1] for c in listed] == [EOS_ID] * 3
    assert state.keep and [c.call_id for c in state.calls] == ids
    ids.append(one_call())
    px.drain()  # the answer can reach the client before its handler records the call (same loop step, after it)
    assert [c.call_id for c in state.calls] == ids  # kept from the first read on
    listed = px.http.get("/lightning/v1/calls", headers=headers).json()["calls"]
    assert [c["call_id"] for c in listed] == ids
