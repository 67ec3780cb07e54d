"""benchmarks/calc_errors.py: each calc rollout sorted into one failure kind (the report over a real run's store is
printed by the slow acceptance run, tests/trainer/test_acceptance.py, through benchmarks/main_job.py)."""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

import pytest

from tests.support.scripts import load_script
from tests.trainer.tiny import ROOT


@pytest.fixture(scope="module")
def calc_errors() -> ModuleType:
    return load_script(ROOT / "benchmarks" / "calc_errors.py", "calc_errors")


TASK = {"question": "Subtract 17 from 64.", "expression": "64-17", "answer": "47"}


def _call(expression: str | None = None, content: str | None = None, arguments: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if expression is not None or arguments is not None:
        args = arguments if arguments is not None else json.dumps({"expression": expression})
        message["tool_calls"] = [{"id": "c", "type": "function", "function": {"name": "calculator", "arguments": args}}]
    return {"response": {"choices": [{"message": message}]}}


@pytest.mark.parametrize(
    ("reward", "calls", "kind"),
    [
        (1.0, [_call("64-17"), _call(content="47")], "ok"),
        (0.0, [], "no call recorded"),
        (0.0, [_call(content="47")], "no tool call"),
        (0.0, [_call(arguments="{not json")], "bad arguments"),
        (0.0, [_call(arguments='{"expr": "64-17"}')], "bad arguments"),
        (0.0, [_call("64 - 17"), _call(content="74")], "right expression, wrong answer"),
        (0.0, [_call("64+17")], "wrong op"),
        (0.0, [_call("17-64")], "swapped"),
        (0.0, [_call("61-17")], "wrong digits"),
        (0.0, [_call("64-")], "malformed"),
    ],
)
def test_each_rollout_gets_one_kind(
    calc_errors: ModuleType, reward: float, calls: list[dict[str, Any]], kind: str
) -> None:
    assert calc_errors.kind_of(TASK, reward, calls) == kind
