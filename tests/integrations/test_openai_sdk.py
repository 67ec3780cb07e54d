"""The OpenAI Python SDK inside @rollout agents, through the real proxy (uvicorn on loopback) to the mock upstream:
sync, async, streaming and a tool loop; every call must land in the SQLite store with exact token ids under the
attempt that made it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from lightning_sdk_integrations.tagging import async_tagging_http_client, tagged, tagging_http_client

import lightning_sdk.agent as la
from tests.agent.stack import assert_calls_traced, proxy_stack
from tests.support.mock_openai import EOS_ID, encode

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    }
]


@la.rollout
def sync_agent(task: dict[str, str], llm: la.LLM) -> float:
    resp = llm.openai_client().chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["q"]}]
    )
    return float(resp.choices[0].message.content == "Hello from the mock upstream.")


@la.rollout
async def streaming_agent(task: dict[str, str], llm: la.LLM) -> float:
    client = llm.async_openai_client()
    stream = await client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": task["q"]}],
        stream=True,
        stream_options={"include_usage": True},
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    return float(text == "Hello from the mock upstream.")


@la.rollout
def tool_agent(task: dict[str, str], llm: la.LLM) -> float:
    client = llm.openai_client()
    messages: list[Any] = [{"role": "user", "content": task["q"]}]
    for _ in range(4):
        msg = client.chat.completions.create(model=llm.model, messages=messages, tools=TOOLS).choices[0].message
        if not msg.tool_calls:
            return float("The tool said: 4" in (msg.content or ""))
        messages.append(msg.model_dump(exclude_none=True))
        for tc in msg.tool_calls:
            expr = json.loads(tc.function.arguments)["query"]
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": str(eval(expr, {}, {}))})
    return 0.0


async def test_sync_async_streaming_and_tools(tmp_path: Path) -> None:
    async with proxy_stack(tmp_path) as st:
        for agent, calls in ((sync_agent, 1), (streaming_agent, 1), (tool_agent, 2)):
            summary = await la.run_tasks(agent, st.store, st.url, [{"q": "2+2"}, {"q": "2*2"}], n_workers=2)
            assert (summary.n, summary.succeeded, summary.mean_reward) == (2, 2, 1.0), summary.to_dict()
            for r in summary.rollouts:
                detail = await st.store.get_rollout(r.rollout_id)
                assert_calls_traced(detail, min_calls=calls)
                ok = detail.succeeded_attempt()
                assert ok is not None and len(ok.calls) == calls
                assert ok.calls[0].request["messages"][0]["content"] == r.task["q"]
                assert "stream" not in ok.calls[0].request
                if agent is tool_agent:
                    first, second = ok.calls
                    assert first.finish_reason == "tool_calls" and first.request["tools"] == TOOLS
                    tool_call = {"name": "calculator", "arguments": json.dumps({"query": r.task["q"]})}
                    want = f"<tool_call>{json.dumps(tool_call, sort_keys=True)}</tool_call>"
                    assert first.completion_ids == [*encode(want), EOS_ID]
                    assert second.request["messages"][-1] == {
                        "role": "tool",
                        "tool_call_id": "call_0",
                        "content": "4",
                    }
                    assert second.completion_ids == [*encode("The tool said: 4"), EOS_ID]


@la.rollout
async def tagged_agent(task: dict[str, str], llm: la.LLM) -> None:
    sync_client = llm.openai_client(http_client=tagging_http_client())
    async_client = llm.async_openai_client(http_client=async_tagging_http_client())
    messages: Any = [{"role": "user", "content": task["q"]}]
    await async_client.chat.completions.create(model=llm.model, messages=messages)  # untagged
    with tagged(lightning_agent="planner"):
        await async_client.chat.completions.create(model=llm.model, messages=messages, metadata={"keep": "me"})
        with tagged(lightning_node="critic"):  # the sync client on a thread: the tags follow the copied context
            await asyncio.to_thread(sync_client.chat.completions.create, model=llm.model, messages=messages)


async def test_tagging_clients_label_calls(tmp_path: Path) -> None:
    async with proxy_stack(tmp_path) as st:
        summary = await la.run_tasks(tagged_agent, st.store, st.url, [{"q": "t"}])
        assert summary.succeeded == 1
        detail = await st.store.get_rollout(summary.rollouts[0].rollout_id)
        assert_calls_traced(detail, min_calls=3)
        ok = detail.succeeded_attempt()
        assert ok is not None
        assert [c.request.get("metadata") for c in ok.calls] == [
            None,
            {"keep": "me", "lightning_agent": "planner"},
            {"lightning_agent": "planner", "lightning_node": "critic"},
        ]
