"""Agno (``Agent`` with the ``OpenAILike`` model): only ``base_url`` and ``api_key`` point at the proxy."""

from __future__ import annotations

import pytest
from agno.agent import Agent
from agno.models.openai.like import OpenAILike

from tests.harnesses.rig import SECRET, TASK, Rig, Session, lookup_secret

pytestmark = pytest.mark.harness


def _agent(s: Session) -> Agent:
    model = OpenAILike(id="policy", base_url=s.base_url, api_key=s.token, max_retries=0)
    return Agent(model=model, tools=[lookup_secret], instructions="Answer with the secret code.", telemetry=False)


def test_run(rig: Rig) -> None:
    s = rig.session()
    out = _agent(s).run(TASK)
    if rig.scripted:
        assert out.content == f"The secret code is {SECRET}."
    calls = rig.verify(s)
    assert calls[0]["request"]["tools"][0]["function"]["name"] == "lookup_secret"


def test_run_streamed(rig: Rig) -> None:
    s = rig.session()
    text = "".join(str(ev.content) for ev in _agent(s).run(TASK, stream=True) if type(ev).__name__ == "RunContentEvent")
    if rig.scripted:
        assert text == f"The secret code is {SECRET}."
    rig.verify(s, streamed=True)
