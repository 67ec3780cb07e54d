"""The Anthropic Messages API on the proxy, with the official ``anthropic`` client, in token mode and passthrough.

See tests/surfaces/conftest.py for what is real (everything but the engine: a scripted engine over the real Qwen3
template in token mode, a scripted vLLM-style upstream in passthrough).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from tests.surfaces.conftest import ScriptedReply, one_segment, passthrough_proxy, recorded_calls, token_proxy
from tests.tokens.conversations import assistant, tool_call

TOOLS = [
    {
        "name": "get_weather",
        "description": "Current weather of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
    {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},  # a server tool: never shown to the policy
]
SYSTEM = [
    {"type": "text", "text": "You are brief."},
    {"type": "text", "text": "Use the tools.", "cache_control": {"type": "ephemeral"}},
]


def _create(client: anthropic.Anthropic, stream: bool, events: list[str], **kwargs: Any) -> Any:
    """``messages.create``, or ``messages.stream`` and its final message (the event types appended to ``events``)."""
    if not stream:
        return client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as s:
        events += [event.type for event in s]
        return s.get_final_message()


def _conversation(client: anthropic.Anthropic, *, stream: bool) -> tuple[Any, Any, Any, list[str]]:
    """Three calls: a tool_use and the tool_result answered (both streamed or not), then a reply cut by a stop
    sequence."""
    events: list[str] = []
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    common: dict[str, Any] = {"model": "policy", "max_tokens": 300, "system": SYSTEM, "tools": TOOLS}
    first = _create(client, stream, events, messages=msgs, metadata={"user_id": "u1"}, **common)
    tool_use = next(b for b in first.content if b.type == "tool_use")
    msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]})
    msgs.append(
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": tool_use.id,
                    "content": "18C and sunny",
                    "cache_control": {"type": "ephemeral"},
                }
            ],
        }
    )
    second = _create(client, stream, events, messages=msgs, **common)
    msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in second.content]})
    msgs.append({"role": "user", "content": "Now say it and stop."})
    third = client.messages.create(messages=msgs, stop_sequences=["STOP"], **common)
    return first, second, third, events


def _check_replies(first: Any, second: Any, third: Any, events: list[str]) -> None:
    assert first.stop_reason == "tool_use" and first.role == "assistant" and first.type == "message"
    tool_use = next(b for b in first.content if b.type == "tool_use")
    assert (tool_use.name, tool_use.input) == ("get_weather", {"city": "Paris"})
    assert second.stop_reason == "end_turn" and second.content[-1].text == "It is 18C and sunny in Paris."
    assert third.stop_reason == "stop_sequence" and third.stop_sequence == "STOP"
    assert third.content[-1].text == "Paris: 18C. "
    if events:
        assert events[0] == "message_start" and events[-1] == "message_stop"
        assert events.count("message_start") == events.count("message_stop") == 2
        assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(events)
        assert {"text", "input_json"} <= set(events)  # the client's own events: text and tool input were parsed


@pytest.mark.parametrize("stream", [False, True])
def test_messages_token_mode_tool_loop_is_one_segment(tmp_path: Path, stream: bool) -> None:
    call = tool_call("get_weather", {"city": "Paris"}, "call00001")
    plans: list[Any] = [
        assistant(None, reasoning="I should look it up.", calls=[call]),
        assistant("It is 18C and sunny in Paris.", reasoning="Answer."),
        assistant("Paris: 18C. STOP and more"),
    ]
    with token_proxy(tmp_path, plans) as (px, engine):
        s = px.session()
        client = anthropic.Anthropic(base_url=px.url, api_key=s["token"], max_retries=0)  # x-api-key
        first, second, third, events = _conversation(client, stream=stream)
        thinking = next(b for b in first.content if b.type == "thinking")
        assert thinking.thinking == "I should look it up." and thinking.signature
        assert first.usage.input_tokens == len(engine.received[0])
        assert first.usage.output_tokens == len(engine.sampled[0])
        _check_replies(first, second, third, events)
        assert px.finish(s["token"]).status_code == 200
        calls = recorded_calls(px, s["rollout_id"])
    assert len(calls) == 3
    for i, c in enumerate(calls):
        assert c.prompt_ids == engine.received[i] and c.completion_ids == engine.sampled[i]
        assert c.logprobs == engine.logprobs[i] and c.policy_version == 7 and c.error is None
        assert c.request["surface"]["api"] == "messages"
        assert c.request["surface"]["hidden_tools"] == ["web_search_20250305:web_search"]
        assert [t["function"]["name"] for t in c.request["tools"]] == ["get_weather"]
        assert c.request["surface"]["request"]["system"] == SYSTEM  # the original request, kept for inspection
    assert [c.checks["render"]["extended"] for c in calls] == [False, True, True]
    assert [c.checks["render"]["split_reason"] for c in calls] == [None, None, None]
    assert engine.sampling[2].stop == ["STOP"]
    assert one_segment(calls)


@pytest.mark.parametrize("stream", [False, True])
def test_messages_passthrough_tool_loop_is_one_segment(tmp_path: Path, stream: bool) -> None:
    script = [
        ScriptedReply(tool_calls=[("get_weather", '{"city": "Paris"}')]),
        ScriptedReply("It is 18C and sunny in Paris."),
        ScriptedReply("Paris: 18C. STOP and more"),
    ]
    with passthrough_proxy(tmp_path, script) as (px, upstream):
        s = px.session()
        client = anthropic.Anthropic(base_url=px.url, auth_token=s["token"], max_retries=0)  # Authorization: Bearer
        first, second, third, events = _conversation(client, stream=stream)
        _check_replies(first, second, third, events)
        assert px.finish(s["token"]).status_code == 200
        calls = recorded_calls(px, s["rollout_id"])
    sent = upstream.requests
    assert [m["role"] for m in sent[1]["messages"]] == ["system", "user", "assistant", "tool"]
    assert sent[1]["messages"][0]["content"] == "You are brief.\nUse the tools."
    assert sent[1]["messages"][3] == {"role": "tool", "tool_call_id": "chatcmpl-tool-10", "content": "18C and sunny"}
    assert all(r["return_token_ids"] is True for r in sent) and sent[2]["stop"] == ["STOP"]
    assert len(calls) == 3
    for i, c in enumerate(calls):
        prompt, completion, lps = upstream.sampled[i]
        assert (c.prompt_ids, c.completion_ids, c.logprobs) == (prompt, completion, lps)
        assert c.token_source == "engine" and c.error is None
    assert one_segment(calls)


def test_messages_auth_errors_and_count_tokens(tmp_path: Path) -> None:
    with token_proxy(tmp_path, [assistant("Hi.")]) as (px, _engine):
        s = px.session()
        msgs = [{"role": "user", "content": "Hello"}]
        bad = anthropic.Anthropic(base_url=px.url, api_key="not-a-token", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as auth:
            bad.messages.create(model="policy", max_tokens=10, messages=msgs)  # type: ignore[arg-type]
        assert auth.value.body["type"] == "error"  # type: ignore[index]
        assert auth.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        # the token in the path, with a query string as Claude Code sends it
        path_client = anthropic.Anthropic(base_url=f"{px.url}/t/{s['token']}", api_key="ignored", max_retries=0)
        counted = path_client.messages.count_tokens(model="policy", messages=msgs, system="Be brief.")  # type: ignore[arg-type]
        assert counted.input_tokens > 5
        r = httpx.post(
            f"{px.url}/v1/messages?beta=true",
            json={"model": "policy", "max_tokens": 10, "messages": msgs},
            headers={"x-api-key": s["token"], "anthropic-version": "2023-06-01"},
        )
        assert r.status_code == 200 and r.json()["content"] == [{"type": "text", "text": "Hi."}]
        for path, headers in [("/v1/models", {"x-api-key": s["token"]}), (f"/t/{s['token']}/v1/models", {})]:
            listed = httpx.get(px.url + path, headers=headers)  # GET /v1/models on every auth form
            assert listed.status_code == 200 and [m["id"] for m in listed.json()["data"]] == ["policy"]
        client = anthropic.Anthropic(base_url=px.url, api_key=s["token"], max_retries=0)
        with pytest.raises(anthropic.BadRequestError) as bad_request:
            client.messages.create(model="policy", max_tokens=0, messages=msgs)  # type: ignore[arg-type]
        assert bad_request.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        assert "max_tokens" in bad_request.value.body["error"]["message"]  # type: ignore[index]
        assert px.finish(s["token"]).status_code == 200
        with pytest.raises(anthropic.APIStatusError) as ended:
            client.messages.create(model="policy", max_tokens=10, messages=msgs)  # type: ignore[arg-type]
        assert ended.value.status_code == 409 and json.loads(ended.value.response.text)["type"] == "error"
