"""A LangGraph ReAct agent with two tools, trainable as is.

The agent is ordinary LangGraph code (``create_react_agent`` over a ``ChatOpenAI``); the only lightning_sdk parts
are the ``@rollout`` decorator and building the chat model on the attempt's ``llm``. The reward compares the
agent's last message with the task's answer (``score``).

Run it over the task set through a proxy (traces land in the proxy's store)::

    lightning-sdk proxy --upstream http://localhost:8000/v1 --store traces.db --admin-key KEY &
    lightning-sdk run examples/langgraph_agent/agent.py:agent --server http://127.0.0.1:4700 \\
        --tasks examples/langgraph_agent/tasks.jsonl --admin-key KEY --workers 4

or as plain code against any OpenAI-compatible endpoint::

    python examples/langgraph_agent/agent.py --base-url http://localhost:8000/v1 --model Qwen/Qwen3-0.6B
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

import lightning_sdk as ls

SYSTEM = (
    "You solve arithmetic word problems. Call the calculator with the arithmetic expression, "
    "then answer with the number only."
)
_EXPR = re.compile(r"[0-9(][0-9+\-*/(). ]*")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
UNITS = {"dozen": 12, "score": 20, "gross": 144, "week": 7, "hour": 60}


def score(answer: str, expected: str) -> float:
    """The reward: 1.0 when the last number in the agent's answer equals the expected one."""
    numbers = _NUMBER.findall(answer.replace(",", ""))
    if not numbers:
        return 0.0
    try:
        return float(abs(float(numbers[-1]) - float(expected)) < 1e-6)
    except ValueError:
        return 0.0


@tool
def calculator(query: str) -> str:
    """Evaluate the arithmetic expression in `query` (digits, + - * / and parentheses)."""
    candidates = sorted((m.group().strip() for m in _EXPR.finditer(query)), key=len, reverse=True)
    for expr in candidates:
        try:
            value = eval(expr, {"__builtins__": {}}, {})  # only digits and operators reach eval
        except (SyntaxError, ZeroDivisionError, TypeError):
            continue
        return str(int(value)) if float(value).is_integer() else f"{value:.4g}"
    return "error: no arithmetic expression found"


@tool
def unit_size(unit: str) -> str:
    """How many items a counting unit holds (dozen, score, gross, week in days, hour in minutes)."""
    return str(UNITS.get(unit.strip().lower(), "unknown unit"))


def build_agent(llm: ls.LLM) -> Any:
    model = ChatOpenAI(base_url=llm.base_url, api_key=llm.api_key, model=llm.model, temperature=1.0)
    return create_react_agent(model, [calculator, unit_size])


@ls.rollout(timeout=120, max_attempts=2)
def agent(task: dict[str, str], llm: ls.LLM) -> float:
    graph = build_agent(llm)
    out = graph.invoke(
        {"messages": [SystemMessage(SYSTEM), HumanMessage(task["question"])]},
        config={"recursion_limit": 12},
    )
    return score(str(out["messages"][-1].content), task["answer"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--model", required=True)
    parser.add_argument("--tasks", default=str(Path(__file__).with_name("tasks.jsonl")))
    args = parser.parse_args()
    llm = ls.LLM(base_url=args.base_url, api_key=args.api_key, model=args.model)
    tasks = [json.loads(line) for line in Path(args.tasks).read_text().splitlines() if line.strip()]
    rewards = [agent(t, llm) for t in tasks]
    print(f"mean reward {sum(rewards) / len(rewards):.3f} over {len(rewards)} tasks")


if __name__ == "__main__":
    main()
