"""DSPy (``dspy.ReAct`` over ``dspy.LM``, its text adapter): only ``api_base`` and ``api_key`` point at the proxy."""

from __future__ import annotations

import dspy
import pytest

from tests.harnesses.rig import SECRET, TASK, Rig, lookup_secret

pytestmark = pytest.mark.harness


def test_react(rig: Rig) -> None:
    s = rig.session()
    lm = dspy.LM("openai/policy", api_base=s.base_url, api_key=s.token, cache=False, num_retries=0)
    react = dspy.ReAct("question -> answer", tools=[lookup_secret], max_iters=3)
    with dspy.context(lm=lm):
        try:
            pred = react(question=TASK)
        except Exception as exc:  # token mode: random text cannot fill DSPy's fields
            if rig.scripted:
                raise
            assert "Adapter" in type(exc).__name__ or "parse" in str(exc).lower(), exc
            pred = None
    if rig.scripted:
        assert pred is not None and pred.answer == SECRET
        assert pred.trajectory["tool_name_0"] == "lookup_secret" and SECRET in pred.trajectory["observation_0"]
    rig.verify(s, tool_calls=False)  # DSPy's ReAct calls tools through its own text fields, not tool_calls
