"""pydantic-ai (``Agent`` with ``OpenAIChatModel``): only the provider's base URL and key point at the proxy."""

from __future__ import annotations

import asyncio

import pytest
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from tests.harnesses.rig import SECRET, TASK, Rig, Session, lookup_secret

pytestmark = pytest.mark.harness


def _agent(s: Session) -> Agent[None, str]:
    model = OpenAIChatModel("policy", provider=OpenAIProvider(base_url=s.base_url, api_key=s.token))
    return Agent(model, tools=[lookup_secret], instructions="Answer with the secret code.", retries=0)


def test_run_sync(rig: Rig) -> None:
    s = rig.session()
    result = _agent(s).run_sync(TASK)
    if rig.scripted:
        assert result.output == f"The secret code is {SECRET}."
    calls = rig.verify(s)
    assert calls[0]["request"]["tools"][0]["function"]["name"] == "lookup_secret"


def test_run_stream(rig: Rig) -> None:
    s = rig.session()

    async def go() -> str:
        async with _agent(s).run_stream(TASK) as run:
            return await run.get_output()

    output = asyncio.run(go())
    if rig.scripted:
        assert output == f"The secret code is {SECRET}."
    rig.verify(s, streamed=True)
