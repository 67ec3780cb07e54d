"""Records from prompts rendered by the proxy's renderer (``lightning_sdk.tokens``) with real tokenizers and
chat templates: a multi-turn conversation with parallel tool calls merges into one segment under the ``exact``
history policy; a parallel sample is a branch; under ``template`` Qwen3 splits where the template drops reasoning,
and the merge's split reasons agree with the renderer's."""

from __future__ import annotations

import json
from typing import Any

import pytest

from lightning_sdk.records import merge_attempt
from lightning_sdk.tokens import ChatRenderer, PriorCall, render_prompt
from lightning_sdk.types import Call
from tests.support.tokenizers import load_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def _tool_call(i: int, city: str) -> dict[str, Any]:
    return {
        "id": f"call{i}",
        "type": "function",
        "function": {"name": "weather", "arguments": json.dumps({"city": city})},
    }


class _Agent:
    """Calls of one attempt, rendered exactly as the proxy does (render_prompt over the earlier calls)."""

    def __init__(self, renderer: ChatRenderer, policy: str = "exact") -> None:
        self.r = renderer
        self.policy = policy
        self.prior: list[PriorCall] = []
        self.calls: list[Call] = []
        self.reasons: list[str | None] = []

    def call(self, messages: list[dict[str, Any]], reply: dict[str, Any], sampled_text: str) -> None:
        rp = render_prompt(self.r, messages, TOOLS, self.prior, policy=self.policy)  # type: ignore[arg-type]
        completion = [*self.r.encode(sampled_text), self.r.token_id(self.r.family.stops[0])]
        seq = len(self.calls)
        self.calls.append(
            Call(
                call_id=f"c{seq}",
                attempt_id="a",
                rollout_id="r",
                seq=seq,
                model="policy",
                token_source="rendered",
                prompt_ids=rp.prompt_ids,
                completion_ids=completion,
                logprobs=[-0.5 - k / 100 for k in range(len(completion))],
                checks={"render": rp.as_check()},
                started_at=float(seq),
                ended_at=seq + 0.5,
            )
        )
        self.reasons.append(rp.split_reason)
        self.prior.append(PriorCall(list(messages), TOOLS, reply, rp.prompt_ids, completion))


def _conversation(agent: _Agent) -> None:
    sys_user: list[dict[str, Any]] = [
        {"role": "system", "content": "You answer weather questions."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
    ]
    reply0: dict[str, Any] = {
        "role": "assistant",
        "content": "",
        "tool_calls": [_tool_call(0, "Paris"), _tool_call(1, "Rome")],
    }
    agent.call(sys_user, reply0, "checking both cities")
    m1: list[dict[str, Any]] = [
        *sys_user,
        reply0,
        {"role": "tool", "tool_call_id": "call0", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call1", "content": "rain"},
    ]
    reply1: dict[str, Any] = {"role": "assistant", "content": "Paris is sunny, Rome rainy."}
    agent.call(m1, reply1, "Paris is sunny, Rome rainy.")
    agent.call(m1, {"role": "assistant", "content": "Sunny and rainy."}, "Sunny and rainy.")  # a parallel sample
    m2: list[dict[str, Any]] = [*m1, reply1, {"role": "user", "content": "And tomorrow?"}]
    agent.call(m2, {"role": "assistant", "content": "Unknown."}, "Unknown.")


@pytest.mark.parametrize("family", ["qwen3", "qwen2.5", "llama3.1"])
def test_exact_history_merges_a_tool_conversation_and_branches_a_parallel_sample(family: str) -> None:
    agent = _Agent(ChatRenderer(load_tokenizer(family)))
    _conversation(agent)
    res = merge_attempt(agent.calls)
    assert [s.split_reason for s in res.segments] == [None, "branch"]
    main, branch = res.segments
    assert [s.call_id for s in main.spans] == ["c0", "c1", "c3"]
    assert [s.call_id for s in branch.spans] == ["c2"]
    for c in agent.calls:
        seg = main if c.call_id != "c2" else branch
        assert seg.input_ids[: len(c.prompt_ids)].tolist() == c.prompt_ids
    assert sum(s.n_trained for s in res.segments) == sum(len(c.completion_ids) for c in agent.calls)
    assert res.stats.prompt_tokens_by_source["rendered"] == sum(len(c.prompt_ids) for c in agent.calls)


def test_qwen3_template_history_splits_where_reasoning_is_dropped_and_agrees_with_the_renderer() -> None:
    r = ChatRenderer(load_tokenizer("qwen3"))
    agent = _Agent(r, policy="template")
    m0 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    reply0 = {"role": "assistant", "content": "4", "reasoning_content": "add"}
    agent.call(m0, reply0, "<think>\nadd\n</think>\n\n4")
    m1 = [*m0, reply0, {"role": "user", "content": "3+3?"}]
    reply1 = {"role": "assistant", "content": "6", "reasoning_content": "add again"}
    agent.call(m1, reply1, "<think>\nadd again\n</think>\n\n6")
    res = merge_attempt(agent.calls)
    assert agent.reasons == [None, "template_rewrite"]
    assert [s.split_reason for s in res.segments] == agent.reasons
    exact = _Agent(r)
    exact.call(m0, reply0, "<think>\nadd\n</think>\n\n4")
    exact.call(m1, reply1, "<think>\nadd again\n</think>\n\n6")
    assert len(merge_attempt(exact.calls).segments) == 1
