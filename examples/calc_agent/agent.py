"""The calc agent: plain OpenAI-SDK code with a calculator tool, made trainable by one decorator.

The model gets an arithmetic question in words and the ``calculator`` tool. It should call the tool with the right
expression, read the result and answer with the number. The reward (``tasks.reward``) is 1.0 for a correct final
answer. Nothing here knows about training: ``llm.base_url`` / ``llm.api_key`` point at the tracing proxy, which
records the exact tokens the policy sampled.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from typing import Any

import openai
from tasks import CALCULATOR_TOOL, evaluate, reward

import lightning_sdk as ls

MAX_TURNS = 3

# One connection pool per event loop, shared by all attempts: building an OpenAI client costs ~50 ms of TLS setup
# (even for http:// URLs), more than a whole episode of the tiny policy. ``with_options`` reuses the pool.
# ``llm.async_openai_client`` is ``openai.AsyncOpenAI`` on a leaner HTTP transport: ~0.7 vs 1.0-1.2 ms of CPU per
# call, which 64 workers sharing two cores with the model notice (any ``openai.AsyncOpenAI`` works the same).
_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, openai.AsyncOpenAI] = weakref.WeakKeyDictionary()


def client_for(llm: ls.LLM) -> openai.AsyncOpenAI:
    loop = asyncio.get_running_loop()
    if loop not in _clients:
        _clients[loop] = llm.async_openai_client(max_retries=0)
    return _clients[loop].with_options(base_url=llm.base_url, api_key=llm.api_key)


@ls.rollout(timeout=120)
async def agent(task: dict[str, Any], llm: ls.LLM) -> float:
    client = client_for(llm)
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["question"]}]
    answer: str | None = None
    for _ in range(MAX_TURNS):
        response = await client.chat.completions.create(
            model=llm.model,
            messages=messages,
            tools=[CALCULATOR_TOOL],
            max_tokens=64,  # type: ignore[arg-type]
        )
        message = response.choices[0].message
        if not message.tool_calls:
            answer = message.content
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            try:
                expression = str(json.loads(call.function.arguments).get("expression", ""))
            except (json.JSONDecodeError, AttributeError):
                expression = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": evaluate(expression)})
    return reward(task, answer)
