"""LiteLLM ``completion``/``acompletion`` and the OpenAI Agents SDK (real libraries) inside @rollout agents, through
the real proxy to the mock upstream; the calls must land under the right attempt with exact token ids."""

from __future__ import annotations

from pathlib import Path

import litellm
import pytest
from agents import Agent, Runner, function_tool
from lightning_sdk_integrations import litellm as ls_litellm
from lightning_sdk_integrations.openai_agents import run_config

import lightning_sdk.agent as la
from tests.agent.stack import assert_calls_traced, proxy_stack

litellm.telemetry = False
pytestmark = pytest.mark.filterwarnings("ignore:.*ReadOnly.*:UserWarning")  # pydantic notes about litellm's types


@la.rollout
def litellm_agent(task: dict[str, str], llm: la.LLM) -> float:
    resp = ls_litellm.completion(llm, [{"role": "user", "content": task["q"]}], max_retries=0)
    return float(resp.choices[0].message.content == "Hello from the mock upstream.")


@la.rollout
async def litellm_async_agent(task: dict[str, str], llm: la.LLM) -> float:
    resp = await litellm.acompletion(**llm.litellm_kwargs(), messages=[{"role": "user", "content": task["q"]}])
    return float(resp.choices[0].message.content == "Hello from the mock upstream.")


@function_tool
def search(query: str) -> str:
    """Search the knowledge base."""
    return f"found {query}"


@la.rollout
async def agents_sdk_agent(task: dict[str, str], llm: la.LLM) -> float:
    agent = Agent(name="assistant", instructions="Use the search tool.", tools=[search], model="gpt-4o")
    result = await Runner.run(agent, task["q"], run_config=run_config(llm))
    return float(result.final_output == f"The tool said: found {task['q']}")


async def test_litellm_completion_sync_and_async(tmp_path: Path) -> None:
    async with proxy_stack(tmp_path) as st:
        for agent in (litellm_agent, litellm_async_agent):
            summary = await la.run_tasks(agent, st.store, st.url, [{"q": "one"}, {"q": "two"}], n_workers=2)
            assert (summary.succeeded, summary.mean_reward) == (2, 1.0), summary.to_dict()
            for r in summary.rollouts:
                detail = await st.store.get_rollout(r.rollout_id)
                assert_calls_traced(detail)
                ok = detail.succeeded_attempt()
                assert ok is not None and len(ok.calls) == 1 and ok.calls[0].model == "policy"
                assert ok.calls[0].request["messages"] == [{"role": "user", "content": r.task["q"]}]


async def test_openai_agents_sdk_runner_with_a_tool(tmp_path: Path) -> None:
    async with proxy_stack(tmp_path) as st:
        summary = await la.run_tasks(agents_sdk_agent, st.store, st.url, [{"q": "x"}, {"q": "y"}], n_workers=2)
        assert (summary.succeeded, summary.mean_reward) == (2, 1.0), summary.to_dict()
        for r in summary.rollouts:
            detail = await st.store.get_rollout(r.rollout_id)
            assert_calls_traced(detail, min_calls=2)
            ok = detail.succeeded_attempt()
            assert ok is not None and len(ok.calls) == 2
            first, second = ok.calls
            assert first.model == "policy"  # the provider maps the Agent's "gpt-4o" to the policy
            assert first.request["tools"][0]["function"]["name"] == "search"
            assert first.request["messages"][0] == {"role": "system", "content": "Use the search tool."}
            assert second.request["messages"][-1]["role"] == "tool"
            assert second.request["messages"][-1]["content"] == f"found {r.task['q']}"
