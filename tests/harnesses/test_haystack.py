"""Haystack (``Agent`` with ``OpenAIChatGenerator``): only ``api_base_url`` and ``api_key`` point at the proxy."""

from __future__ import annotations

import pytest
from haystack.components.agents import Agent
from haystack.components.generators.chat import OpenAIChatGenerator
from haystack.dataclasses import ChatMessage, StreamingChunk
from haystack.tools import create_tool_from_function
from haystack.utils import Secret

from tests.harnesses.rig import SECRET, TASK, Rig, lookup_secret

pytestmark = pytest.mark.harness


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_agent(rig: Rig, stream: bool) -> None:
    s = rig.session()
    chunks: list[StreamingChunk] = []
    generator = OpenAIChatGenerator(api_key=Secret.from_token(s.token), model="policy", api_base_url=s.base_url)
    agent = Agent(
        chat_generator=generator,
        tools=[create_tool_from_function(lookup_secret)],
        streaming_callback=chunks.append if stream else None,
        max_agent_steps=4,
    )
    agent.warm_up()
    result = agent.run(messages=[ChatMessage.from_user(TASK)])
    if rig.scripted:
        assert result["last_message"].text == f"The secret code is {SECRET}."
    if stream:
        assert chunks
    calls = rig.verify(s, streamed=stream)
    assert calls[0]["request"]["tools"][0]["function"]["name"] == "lookup_secret"
