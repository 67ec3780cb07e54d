#!/usr/bin/env python
"""A command-line agent: any program that reads the usual OpenAI environment variables can be trained.

It knows nothing about lightning_sdk. It asks the model (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``OPENAI_MODEL``)
to solve ``--question``, lets it call a ``python_eval`` tool for arithmetic, and prints the final answer on its last
line. Run by hand::

    OPENAI_BASE_URL=http://localhost:8000/v1 OPENAI_API_KEY=none OPENAI_MODEL=Qwen/Qwen3-0.6B \\
        python examples/cli_agent/solve.py --question "What is 17 * 23?"
"""

from __future__ import annotations

import argparse
import json
import os
import re

import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python_eval",
            "description": "Evaluate an arithmetic expression (digits, + - * / and parentheses).",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    }
]
_EXPR = re.compile(r"[0-9(][0-9+\-*/(). ]*")


def python_eval(query: str) -> str:
    for expr in sorted((m.group().strip() for m in _EXPR.finditer(query)), key=len, reverse=True):
        try:
            value = eval(expr, {"__builtins__": {}}, {})  # only digits and operators reach eval
        except (SyntaxError, ZeroDivisionError, TypeError):
            continue
        return str(int(value)) if float(value).is_integer() else f"{value:.4g}"
    return "error: no arithmetic expression found"


def main() -> None:
    parser = argparse.ArgumentParser(description="Answer an arithmetic question with a tool-using model.")
    parser.add_argument("--question", required=True)
    parser.add_argument("--max-turns", type=int, default=4)
    args = parser.parse_args()

    client = openai.OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
    model = os.environ.get("OPENAI_MODEL", "policy")
    messages: list[dict[str, object]] = [
        {"role": "system", "content": "Use python_eval for arithmetic, then answer with the number only."},
        {"role": "user", "content": args.question},
    ]
    for _ in range(args.max_turns):
        msg = client.chat.completions.create(model=model, messages=messages, tools=TOOLS).choices[0].message  # type: ignore[arg-type]
        if not msg.tool_calls:
            print(msg.content or "")
            return
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            query = json.loads(call.function.arguments).get("query", "")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": python_eval(query)})
    print("no answer")


if __name__ == "__main__":
    main()
