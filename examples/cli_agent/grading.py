"""The reward of the CLI example: ``score(task, stdout, exit_code)`` is 1.0 when the last number the program
printed equals the task's answer (0.0 on a non-zero exit)."""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def score(task: dict[str, str], stdout: str, exit_code: int) -> float:
    if exit_code != 0:
        return 0.0
    numbers = _NUMBER.findall(stdout.replace(",", ""))
    return float(bool(numbers) and abs(float(numbers[-1]) - float(task["answer"])) < 1e-6)
