"""A two-role agent for the multi-policy tests: a planner call, then a coder call that reads the plan, each a policy
of its own (``model="planner"``, ``model="coder"``) behind the same proxy, plus one call to a model the run does not
serve (refused: 404 ``model_not_found``, which the agent checks and goes on). Plain OpenAI-SDK code.

The reward comes from the coder's reply alone (its length in characters, mod 5, over 4): it differs between rollouts
of a task, so both policies get non-zero advantages from the same rollout reward.
"""

from __future__ import annotations

from typing import Any

import openai

import lightning_sdk as ls

MAX_TOKENS = 12


@ls.rollout(timeout=120)
async def agent(task: dict[str, Any], llm: ls.LLM) -> float:
    client = llm.async_openai_client(max_retries=0)
    question = [{"role": "user", "content": task["question"]}]
    plan = await client.chat.completions.create(model="planner", messages=question, max_tokens=MAX_TOKENS)
    steps = plan.choices[0].message.content or ""
    try:
        await client.chat.completions.create(model="reviewer", messages=question, max_tokens=4)
        raise AssertionError("a model the run does not serve was answered")
    except openai.NotFoundError as exc:
        body: Any = exc.body
        if not (isinstance(body, dict) and body.get("param") == "model" and body.get("code") == "model_not_found"):
            raise AssertionError(f"unexpected refusal body {body!r}") from exc
    code = await client.chat.completions.create(
        model="coder",
        messages=[*question, {"role": "user", "content": f"plan: {steps}"}],
        max_tokens=MAX_TOKENS,
    )
    return (len(code.choices[0].message.content or "") % 5) / 4
