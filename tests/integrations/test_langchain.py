"""LangChain ChatOpenAI and LangGraph ReAct agents (real frameworks) through the real proxy to the mock upstream.
Asserts the calls landed under the right attempt with exact token ids, and that ``LightningCallbackHandler`` tagged
each sub-agent's calls in a supervisor-style graph (sync and async)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypedDict

from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, StateGraph
from langgraph.prebuilt import create_react_agent
from lightning_sdk_integrations.langchain import chat_model, tags_from_metadata

import lightning_sdk.agent as la
from tests.agent.stack import assert_calls_traced, proxy_stack


@tool
def lookup(query: str) -> str:
    """Look something up."""
    return f"facts about {query}"


@la.rollout
def chat_agent(task: dict[str, str], llm: la.LLM) -> float:
    reply = chat_model(llm).invoke([HumanMessage(task["q"])])
    return float(reply.content == "Hello from the mock upstream.")


@la.rollout
def react_agent(task: dict[str, str], llm: la.LLM) -> float:
    agent = create_react_agent(chat_model(llm), [lookup])
    out = agent.invoke({"messages": [HumanMessage(task["q"])]})
    return float(out["messages"][-1].content == f"The tool said: facts about {task['q']}")


class Team(TypedDict):
    messages: list[Any]


def _team(llm: la.LLM) -> Any:
    model = chat_model(llm)
    graph = StateGraph(Team)
    graph.add_node("researcher", create_react_agent(model, [lookup]))
    graph.add_node("writer", create_react_agent(model, []))
    graph.add_edge(START, "researcher")
    graph.add_edge("researcher", "writer")
    graph.add_edge("writer", END)
    return graph.compile()


@la.rollout
async def team_agent(task: dict[str, str], llm: la.LLM) -> float:
    out = await _team(llm).ainvoke({"messages": [HumanMessage(task["q"])]})
    return float(out["messages"][-1].content == "Hello from the mock upstream.")


@la.rollout
def sync_team_agent(task: dict[str, str], llm: la.LLM) -> float:
    out = _team(llm).invoke({"messages": [HumanMessage(task["q"])]})
    return float(out["messages"][-1].content == "Hello from the mock upstream.")


def test_tags_from_metadata() -> None:
    assert tags_from_metadata(None) == {"lightning_agent": "main"}
    assert tags_from_metadata({"langgraph_checkpoint_ns": "agent:1", "langgraph_node": "agent"}) == {
        "lightning_agent": "main",
        "lightning_node": "agent",
    }
    md = {"langgraph_checkpoint_ns": "team:1|researcher:2|agent:3", "langgraph_node": "agent"}
    assert tags_from_metadata(md) == {"lightning_agent": "team/researcher", "lightning_node": "agent"}
    assert tags_from_metadata({"lightning_agent": "judge"}, "x") == {"lightning_agent": "judge"}


async def test_chat_openai_and_react_agent(tmp_path: Path) -> None:
    async with proxy_stack(tmp_path) as st:
        for agent, calls in ((chat_agent, 1), (react_agent, 2)):
            summary = await la.run_tasks(agent, st.store, st.url, [{"q": "paris"}, {"q": "rome"}], n_workers=2)
            assert (summary.succeeded, summary.mean_reward) == (2, 1.0), summary.to_dict()
            for r in summary.rollouts:
                detail = await st.store.get_rollout(r.rollout_id)
                assert_calls_traced(detail, min_calls=calls)
                ok = detail.succeeded_attempt()
                assert ok is not None and len(ok.calls) == calls
                assert ok.calls[0].request["messages"][-1]["content"] == r.task["q"]
                if agent is react_agent:
                    assert ok.calls[0].request["tools"][0]["function"]["name"] == "lookup"
                    assert ok.calls[0].finish_reason == "tool_calls"
                    assert ok.calls[1].request["messages"][-1]["role"] == "tool"
                    assert ok.calls[0].request["metadata"] == {"lightning_agent": "main", "lightning_node": "agent"}


async def test_supervisor_graph_tags_each_sub_agent(tmp_path: Path) -> None:
    async with proxy_stack(tmp_path) as st:
        for agent in (team_agent, sync_team_agent):
            summary = await la.run_tasks(agent, st.store, st.url, [{"q": "a"}, {"q": "b"}], n_workers=2)
            assert (summary.succeeded, summary.mean_reward) == (2, 1.0), summary.to_dict()
            for r in summary.rollouts:
                detail = await st.store.get_rollout(r.rollout_id)
                assert_calls_traced(detail, min_calls=3)
                ok = detail.succeeded_attempt()
                assert ok is not None
                tags = [c.request.get("metadata", {}).get("lightning_agent") for c in ok.calls]
                assert tags == ["researcher", "researcher", "writer"], tags
