"""smolagents (``ToolCallingAgent``, ``OpenAIServerModel``): only ``api_base`` and ``api_key`` point at the proxy."""

from __future__ import annotations

import pytest
from smolagents import OpenAIServerModel, ToolCallingAgent, tool

from tests.harnesses.rig import SECRET, TASK, Rig, lookup_secret

pytestmark = pytest.mark.harness


@tool
def lookup_secret_tool(query: str) -> str:
    """Look up a secret in the vault.

    Args:
        query: what to look up.
    """
    return lookup_secret(query)


lookup_secret_tool.name = "lookup_secret"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_tool_calling_agent(rig: Rig, stream: bool) -> None:
    s = rig.session()
    model = OpenAIServerModel(model_id="policy", api_base=s.base_url, api_key=s.token)
    agent = ToolCallingAgent(
        tools=[lookup_secret_tool], model=model, max_steps=3, verbosity_level=0, stream_outputs=stream
    )
    output = agent.run(TASK)
    if rig.scripted:
        assert output == SECRET
        assert [type(step).__name__ for step in agent.memory.steps].count("ActionStep") == 2
    calls = rig.verify(s, streamed=stream)
    names = {t["function"]["name"] for t in calls[0]["request"]["tools"]}
    assert {"lookup_secret", "final_answer"} <= names
