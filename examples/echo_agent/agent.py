"""The echo agent: one OpenAI-SDK chat call, the reply checked in the exact form the question asks for.

Nothing here knows about training: ``llm.base_url`` / ``llm.api_key`` point at the tracing proxy, which records the
exact tokens the policy sampled.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

import openai
from tasks import reward

import lightning_sdk as ls

# One connection pool per event loop, shared by all attempts (building a client costs more than a short episode).
_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, openai.AsyncOpenAI] = weakref.WeakKeyDictionary()


def client_for(llm: ls.LLM) -> openai.AsyncOpenAI:
    loop = asyncio.get_running_loop()
    if loop not in _clients:
        _clients[loop] = llm.async_openai_client(max_retries=0)
    return _clients[loop].with_options(base_url=llm.base_url, api_key=llm.api_key)


@ls.rollout(timeout=300)
async def agent(task: dict[str, Any], llm: ls.LLM) -> float:
    response = await client_for(llm).chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": task["question"]}],
        max_tokens=16,  # type: ignore[arg-type]
    )
    return reward(task, response.choices[0].message.content)
