"""The OpenAI Responses API on the proxy, with the official ``openai`` client and the OpenAI Agents SDK, in token
mode and passthrough.

See tests/surfaces/conftest.py for what is real (everything but the engine: a scripted engine over the real Qwen3
template in token mode, a scripted vLLM-style upstream in passthrough).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import openai
import pytest

from lightning_sdk.proxy.surfaces._chat import read_opaque_ref
from tests.surfaces.conftest import ScriptedReply, one_segment, passthrough_proxy, recorded_calls, token_proxy
from tests.tokens.conversations import assistant, tool_call

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "strict": False,
    },
    {
        "type": "namespace",
        "name": "geo",
        "description": "Places",
        "tools": [
            {
                "type": "function",
                "name": "locate",
                "description": "Coordinates of a place",
                "parameters": {"type": "object", "properties": {"place": {"type": "string"}}, "required": ["place"]},
            }
        ],
    },
    {"type": "web_search", "external_web_access": False},  # hosted: never shown to the policy, never a 400
]


def _conversation(client: openai.OpenAI) -> tuple[list[Any], list[str]]:
    """Four calls: a function call; Codex-style re-send of everything + function_call_output (streamed); then
    previous_response_id with a user turn (a namespaced call) and with its function_call_output."""
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}
    first = client.responses.create(
        model="policy",
        instructions="Be brief.",
        input=[user],  # type: ignore[list-item]
        tools=TOOLS,  # type: ignore[arg-type]
        store=False,
        include=["reasoning.encrypted_content"],
    )
    call = next(item for item in first.output if item.type == "function_call")
    items = [user, *[item.model_dump(exclude_none=True) for item in first.output]]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "18C and sunny"})
    events: list[str] = []
    second = None
    with client.responses.create(
        model="policy",
        instructions="Be brief.",
        input=items,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        stream=True,
        store=False,
        include=["reasoning.encrypted_content"],
    ) as stream:
        for event in stream:
            events.append(event.type)
            if event.type == "response.completed":
                second = event.response
    assert second is not None
    third = client.responses.create(
        model="policy",
        instructions="Be brief.",
        previous_response_id=second.id,
        input="Where is the Eiffel Tower?",
        tools=TOOLS,  # type: ignore[arg-type]
    )
    located = next(item for item in third.output if item.type == "function_call")
    fourth = client.responses.create(
        model="policy",
        instructions="Be brief.",
        previous_response_id=third.id,
        input=[{"type": "function_call_output", "call_id": located.call_id, "output": "48.86N 2.29E"}],
        tools=TOOLS,  # type: ignore[arg-type]
    )
    return [first, second, third, fourth], events


def _check(responses: list[Any], events: list[str]) -> None:
    first, second, third, fourth = responses
    call = next(item for item in first.output if item.type == "function_call")
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert call.id.startswith("fc_") and call.status == "completed" and first.status == "completed"
    assert second.output_text == "It is 18C and sunny in Paris."
    assert events[:2] == ["response.created", "response.in_progress"] and events[-1] == "response.completed"
    assert {"response.output_item.added", "response.output_text.delta", "response.output_item.done"} <= set(events)
    assert events.count("response.output_item.added") == events.count("response.output_item.done")
    located = next(item for item in third.output if item.type == "function_call")
    assert located.name == "locate" and located.model_dump()["namespace"] == "geo"  # mapped back from geo__locate
    assert fourth.output_text == "It is at 48.86N 2.29E."
    assert fourth.previous_response_id == third.id and fourth.usage is not None and fourth.usage.output_tokens > 0


def test_responses_token_mode_tool_loops_are_one_segment(tmp_path: Path) -> None:
    plans: list[Any] = [
        assistant(None, reasoning="Look it up.", calls=[tool_call("get_weather", {"city": "Paris"}, "call00001")]),
        assistant("It is 18C and sunny in Paris.", reasoning="Answer."),
        assistant(None, calls=[tool_call("geo__locate", {"place": "Eiffel Tower"}, "call00002")]),
        assistant("It is at 48.86N 2.29E."),
    ]
    with token_proxy(tmp_path, plans) as (px, engine):
        s = px.session()
        client = openai.OpenAI(base_url=f"{px.url}/v1", api_key=s["token"], max_retries=0)
        responses, events = _conversation(client)
        _check(responses, events)
        reasoning = next(item for item in responses[0].output if item.type == "reasoning")
        assert reasoning.summary[0].text == "Look it up."
        assert read_opaque_ref(reasoning.encrypted_content) is not None  # resolvable to the recorded call
        assert "response.reasoning_summary_text.delta" in events
        with pytest.raises(openai.BadRequestError) as unknown:
            client.responses.create(model="policy", previous_response_id="resp_nope", input="hi")
        assert unknown.value.body["param"] == "previous_response_id"  # type: ignore[index]
        assert px.finish(s["token"]).status_code == 200
        calls = recorded_calls(px, s["rollout_id"])
    assert read_opaque_ref(reasoning.encrypted_content) == calls[0].call_id
    ok = [c for c in calls if c.error is None]
    assert len(ok) == 4 and calls[-1].error is not None  # the refused previous_response_id call is recorded
    for i, c in enumerate(ok):
        assert c.prompt_ids == engine.received[i] and c.completion_ids == engine.sampled[i]
        assert c.logprobs == engine.logprobs[i]
        assert c.request["surface"]["hidden_tools"] == ["web_search"]
        assert {t["function"]["name"] for t in c.request["tools"]} == {"get_weather", "geo__locate"}
    assert [c.checks["render"]["split_reason"] for c in ok] == [None, None, None, None]
    assert [c.checks["render"]["extended"] for c in ok] == [False, True, True, True]
    assert one_segment(ok)


def test_responses_passthrough_tool_loops_are_one_segment(tmp_path: Path) -> None:
    script = [
        ScriptedReply(tool_calls=[("get_weather", '{"city": "Paris"}')]),
        ScriptedReply("It is 18C and sunny in Paris."),
        ScriptedReply(tool_calls=[("geo__locate", '{"place": "Eiffel Tower"}')]),
        ScriptedReply("It is at 48.86N 2.29E."),
    ]
    with passthrough_proxy(tmp_path, script) as (px, upstream):
        s = px.session()
        client = openai.OpenAI(base_url=f"{px.url}/t/{s['token']}/v1", api_key="ignored", max_retries=0)
        responses, events = _conversation(client)
        _check(responses, events)
        assert px.finish(s["token"]).status_code == 200
        calls = recorded_calls(px, s["rollout_id"])
    assert [m["role"] for m in upstream.requests[3]["messages"]] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
        "assistant",
        "tool",
    ]
    assert len(calls) == 4
    for i, c in enumerate(calls):
        assert (c.prompt_ids, c.completion_ids, c.logprobs) == upstream.sampled[i]
    assert one_segment(calls)


def test_agents_sdk_default_responses_model_through_the_proxy(tmp_path: Path) -> None:
    """The OpenAI Agents SDK's default model (``OpenAIResponsesModel``) runs a tool loop through the proxy."""
    from agents import Agent, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_responses import OpenAIResponsesModel

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        return f"18C in {city}"

    plans: list[Any] = [
        assistant(None, calls=[tool_call("get_weather", {"city": "Paris"}, "call00001")]),
        assistant("Paris: 18C."),
    ]
    set_tracing_disabled(True)
    with token_proxy(tmp_path, plans) as (px, engine):
        s = px.session()
        client = openai.AsyncOpenAI(base_url=f"{px.url}/v1", api_key=s["token"], max_retries=0)
        agent = Agent(
            name="weather",
            instructions="Answer with the tool.",
            tools=[get_weather],
            model=OpenAIResponsesModel(model="policy", openai_client=client),
        )
        result = asyncio.run(Runner.run(agent, "Weather in Paris?"))
        assert result.final_output == "Paris: 18C."
        assert px.finish(s["token"]).status_code == 200
        calls = recorded_calls(px, s["rollout_id"])
    assert len(calls) == 2 and all(c.request["surface"]["api"] == "responses" for c in calls)
    call_id = calls[0].response["choices"][0]["message"]["tool_calls"][0]["id"]  # the proxy's id (Qwen3 writes none)
    assert calls[1].request["messages"][-1] == {"role": "tool", "tool_call_id": call_id, "content": "18C in Paris"}
    for i, c in enumerate(calls):
        assert c.prompt_ids == engine.received[i] and c.completion_ids == engine.sampled[i]
    assert one_segment(calls)
