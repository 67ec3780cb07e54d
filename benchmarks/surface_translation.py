"""Request translation cost: the proxy's own surface translation vs LiteLLM's, on coding-agent-sized requests.

    python benchmarks/surface_translation.py [--turns 20] [--repeat 200]

Builds a Claude-Code-shaped Messages request (three system blocks, twelve tools with input schemas, ``turns`` rounds
of assistant ``tool_use`` + user ``tool_result``) and a Codex-shaped Responses request (developer and user message
items, function tools, a namespace, ``web_search``, ``turns`` rounds of ``function_call`` + ``function_call_output``)
and times translating each to the chat-completions form, per request, with:

* ``lightning_sdk.proxy.surfaces`` (``MessagesSurface.translate`` / ``ResponsesSurface.translate``, with the
  recognition index of the earlier calls built from scratch each time, as the proxy does);
* LiteLLM's adapters (``LiteLLMAnthropicMessagesAdapter.translate_anthropic_to_openai``,
  ``LiteLLMCompletionResponsesConfig.transform_responses_api_request_to_chat_completion_request``) — the baseline.

Prints microseconds per request and the ratio (LiteLLM / ours). Runs on CPU in seconds; the machines are shared,
so compare the ratio, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from lightning_sdk.proxy.surfaces import MessagesSurface, ResponsesSurface
from lightning_sdk.proxy.surfaces._chat import PriorReplies

SCHEMA = {
    "type": "object",
    "properties": {"command": {"type": "string", "description": "x" * 200}, "timeout": {"type": "number"}},
    "required": ["command"],
}


def messages_request(turns: int) -> dict[str, Any]:
    tools = [{"name": f"Tool{i}", "description": "d" * 800, "input_schema": SCHEMA} for i in range(12)]
    system = [
        {"type": "text", "text": "s" * 70},
        {"type": "text", "text": "t" * 5500, "cache_control": {"type": "ephemeral"}},
    ]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "u" * 2000}]}]
    for i in range(turns):
        msgs.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": f"Step {i}."},
                    {"type": "tool_use", "id": f"toolu_{i}", "name": "Tool1", "input": {"command": f"ls {i}"}},
                ],
            }
        )
        result = {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": "o" * 1500, "is_error": False}
        msgs.append({"role": "user", "content": [result]})
    return {"model": "policy", "max_tokens": 32000, "system": system, "tools": tools, "messages": msgs, "stream": True}


def responses_request(turns: int) -> dict[str, Any]:
    tools: list[dict[str, Any]] = [
        {"type": "function", "name": f"fn{i}", "description": "d" * 800, "parameters": SCHEMA, "strict": False}
        for i in range(8)
    ]
    tools.append({"type": "web_search"})
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "i" * 6000}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "u" * 2000}]},
    ]
    for i in range(turns):
        args = json.dumps({"command": f"ls {i}"})
        items.append(
            {"type": "function_call", "id": f"fc_{i}", "call_id": f"call_{i}", "name": "fn1", "arguments": args}
        )
        items.append({"type": "function_call_output", "call_id": f"call_{i}", "output": "o" * 1500})
    return {"model": "policy", "input": items, "tools": tools, "stream": True, "store": False, "tool_choice": "auto"}


def per_request_us(fn: Callable[[], Any], repeat: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=20, help="tool rounds in each request")
    parser.add_argument("--repeat", type=int, default=200, help="translations timed per variant")
    args = parser.parse_args()

    from litellm.llms.anthropic.messages.adapters.transformation import LiteLLMAnthropicMessagesAdapter
    from litellm.responses.litellm_completion_transformation.transformation import LiteLLMCompletionResponsesConfig

    msg = messages_request(args.turns)
    rsp = responses_request(args.turns)
    messages, responses, adapter = MessagesSurface(), ResponsesSurface(), LiteLLMAnthropicMessagesAdapter()
    params = {k: v for k, v in rsp.items() if k not in ("model", "input", "stream")}

    rows = [
        (
            "messages",
            len(json.dumps(msg)),
            per_request_us(lambda: messages.translate(msg, PriorReplies(()), "call-bench"), args.repeat),
            per_request_us(
                lambda: adapter.translate_anthropic_to_openai(msg, custom_llm_provider="openai"),  # type: ignore[arg-type]
                args.repeat,
            ),
        ),
        (
            "responses",
            len(json.dumps(rsp)),
            per_request_us(lambda: responses.translate(rsp, PriorReplies(()), "call-bench"), args.repeat),
            per_request_us(
                lambda: LiteLLMCompletionResponsesConfig.transform_responses_api_request_to_chat_completion_request(
                    model="policy",
                    input=rsp["input"],
                    responses_api_request=params,  # type: ignore[arg-type]
                    custom_llm_provider="openai",
                    stream=True,
                ),
                args.repeat,
            ),
        ),
    ]
    print(f"{'surface':<10} {'body bytes':>10} {'ours us/req':>12} {'litellm us/req':>15} {'ratio':>6}")
    for name, size, ours, theirs in rows:
        print(f"{name:<10} {size:>10} {ours:>12.1f} {theirs:>15.1f} {theirs / ours:>6.1f}x")
    print("(ours includes building the recognition index of earlier calls and the recognition of each assistant turn)")


if __name__ == "__main__":
    main()
