"""The reward of the LangGraph example: 1.0 when the last number in the agent's answer equals the expected one."""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def score(answer: str, expected: str) -> float:
    numbers = _NUMBER.findall(answer.replace(",", ""))
    if not numbers:
        return 0.0
    try:
        return float(abs(float(numbers[-1]) - float(expected)) < 1e-6)
    except ValueError:
        return 0.0
