"""Arithmetic tasks, demonstrations and the reward of the calc agent example.

A task is a question in words ("Subtract 17 from 64.", "What is 23 times 4?"). The agent must call the
``calculator`` tool with the right expression (pick the operation from the wording, keep the operand order: "subtract
a from b" is ``b-a``), read the tool's result and answer with the number. The reward is 1.0 when the final answer
equals the true result.

Train and held-out tasks are disjoint: a (question template, a, b) triple lands in one split by a stable hash, so no
held-out question is ever trained on, not even in the warm start's demonstrations.

Run ``python examples/calc_agent/tasks.py OUT_DIR`` to write ``train.jsonl``, ``heldout.jsonl`` and
``demos.jsonl``.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import sys
from pathlib import Path
from typing import Any

CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with two integers and one of + - *.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}

# (template, operator): the expression is always "{a} op {b}"; some templates name b first.
TEMPLATES: list[tuple[str, str]] = [
    ("What is {a} plus {b}?", "+"),
    ("Add {a} and {b}.", "+"),
    ("What is the sum of {a} and {b}?", "+"),
    ("What is {a} minus {b}?", "-"),
    ("Subtract {b} from {a}.", "-"),
    ("What is {a} take away {b}?", "-"),
    ("What is {a} times {b}?", "*"),
    ("Multiply {a} by {b}.", "*"),
    ("What is the product of {a} and {b}?", "*"),
]


def _split_of(template: int, a: int, b: int) -> str:
    digest = hashlib.sha256(f"{template}:{a}:{b}".encode()).digest()
    return "heldout" if digest[0] < 26 else "train"  # ~10% held out


def _operands(rng: random.Random, op: str) -> tuple[int, int]:
    if op == "*":
        return rng.randint(2, 99), rng.randint(2, 9)
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    if op == "-" and b > a:
        a, b = b, a
    return a, b


def make_task(rng: random.Random, split: str) -> dict[str, Any]:
    """One task of ``split`` ("train" or "heldout"): ``{"question", "expression", "answer"}``."""
    while True:
        t = rng.randrange(len(TEMPLATES))
        template, op = TEMPLATES[t]
        a, b = _operands(rng, op)
        if _split_of(t, a, b) != split:
            continue
        expression = f"{a}{op}{b}"
        question = template.format(a=a, b=b)
        return {"question": question, "expression": expression, "answer": evaluate(expression)}


def make_tasks(n: int, split: str, seed: int) -> list[dict[str, Any]]:
    """``n`` distinct tasks of one split."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    while len(out) < n:
        task = make_task(rng, split)
        if task["question"] not in seen:
            seen.add(task["question"])
            out.append(task)
    return out


_EXPR = re.compile(r"^\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*$")


def evaluate(expression: str) -> str:
    """The calculator: ``"a op b"`` with integers and one of + - *; an error message otherwise."""
    m = _EXPR.match(expression)
    if m is None:
        return "error: expected 'a op b'"
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def reward(task: dict[str, Any], final_answer: str | None) -> float:
    """1.0 when the last number in the final answer equals the true result."""
    if not final_answer:
        return 0.0
    numbers = re.findall(r"-?\d+", final_answer)
    return 1.0 if numbers and numbers[-1] == task["answer"] else 0.0


def demonstration(task: dict[str, Any]) -> dict[str, Any]:
    """The ideal episode of a task as chat messages + tools (what the warm start imitates)."""
    arguments = json.dumps({"expression": task["expression"]})
    return {
        "tools": [CALCULATOR_TOOL],
        "messages": [
            {"role": "user", "content": task["question"]},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": arguments}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_0", "content": task["answer"]},
            {"role": "assistant", "content": task["answer"]},
        ],
    }


def write_all(out_dir: str | Path, *, n_train: int = 4000, n_heldout: int = 200, n_demos: int = 2000) -> None:
    """Write train/held-out tasks and demonstrations (JSONL)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train = make_tasks(n_train, "train", seed=1)
    heldout = make_tasks(n_heldout, "heldout", seed=2)
    demos = [demonstration(t) for t in make_tasks(n_demos, "train", seed=3)]
    for name, rows in (("train", train), ("heldout", heldout), ("demos", demos)):
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


# -- sources named by train.toml (called with no arguments) -----------------------------------------------------------
def train_tasks() -> list[dict[str, Any]]:
    return make_tasks(4000, "train", seed=1)


def heldout_tasks() -> list[dict[str, Any]]:
    return make_tasks(200, "heldout", seed=2)


def demonstrations() -> list[dict[str, Any]]:
    return [demonstration(t) for t in make_tasks(2000, "train", seed=3)]


def validation_tasks() -> list[dict[str, Any]]:
    return make_tasks(64, "train", seed=5)


if __name__ == "__main__":
    write_all(sys.argv[1] if len(sys.argv) > 1 else ".")
