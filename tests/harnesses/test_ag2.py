"""AG2 (``ag2.Agent`` with ``OpenAIConfig``): only ``base_url`` and ``api_key`` point at the proxy."""

from __future__ import annotations

import asyncio

import pytest
from ag2 import Agent
from ag2.config import OpenAIConfig

from tests.harnesses.rig import SECRET, TASK, Rig, lookup_secret

pytestmark = pytest.mark.harness


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_agent_ask(rig: Rig, stream: bool) -> None:
    s = rig.session()
    config = OpenAIConfig(model="policy", base_url=s.base_url, api_key=s.token, streaming=stream)
    agent = Agent("assistant", prompt="Answer with the secret code.", config=config, tools=[lookup_secret])
    reply = asyncio.run(agent.ask(TASK))
    if rig.scripted:
        assert reply.body == f"The secret code is {SECRET}."
    calls = rig.verify(s, streamed=stream)
    assert calls[0]["request"]["tools"][0]["function"]["name"] == "lookup_secret"
