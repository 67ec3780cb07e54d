"""The reward: after the agent submits, run FAIL_TO_PASS and PASS_TO_PASS in a fresh sandbox.

The fresh sandbox holds the agent's final repository (its snapshot, any ``tests/`` it wrote dropped) plus the hidden
tests (``tasks.hidden_tests``) and a small runner; the tests run with no network under the sandbox's limits. 1.0
when every listed test passes, else 0.0 (also when the agent never submitted, broke the import or made a test hang).
A sandbox that cannot be created or run raises ``SandboxError``: the attempt fails and is retried, never scored 0.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from tasks import hidden_tests

from lightning_sdk.sandbox import Sandbox

RUNNER = """import importlib, json, sys, traceback
passed, failed = [], {}
for test_id in sys.argv[1:]:
    path, _, name = test_id.partition("::")
    try:
        module = importlib.import_module(path[:-3].replace("/", "."))
        getattr(module, name)()
        passed.append(test_id)
    except BaseException as exc:
        failed[test_id] = f"{type(exc).__name__}: {exc}"[:200]
print(json.dumps({"passed": passed, "failed": failed}))
"""
TEST_TIMEOUT_S = 20.0


def submitted(stdout: str) -> bool:
    lines = stdout.strip().splitlines()
    try:
        return bool(lines and json.loads(lines[-1]).get("submitted"))
    except (ValueError, AttributeError):
        return False


async def run_tests(task: dict[str, Any], sandbox: Sandbox) -> dict[str, Any]:
    """Run the task's FAIL_TO_PASS + PASS_TO_PASS on a fresh copy of ``sandbox``: ``{"passed", "failed"}``."""
    files = {p: t for p, t in sandbox.snapshot().items() if not p.startswith("tests/") and p != "_run_tests.py"}
    files.update(hidden_tests(task))
    files["tests/__init__.py"] = ""
    files["_run_tests.py"] = RUNNER
    ids = [*task["FAIL_TO_PASS"], *task["PASS_TO_PASS"]]
    async with await sandbox.fresh(files) as box:
        result = await box.exec([sys.executable, "-S", "-B", "_run_tests.py", *ids], timeout=TEST_TIMEOUT_S)
    if result.timed_out:
        return {"passed": [], "failed": {"*": f"the tests took more than {TEST_TIMEOUT_S} s"}}
    try:
        out: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"passed": [], "failed": {"*": f"the runner crashed (exit {result.exit_code}): {result.stderr[-300:]}"}}
    return out


def _resolved(task: dict[str, Any], result: dict[str, Any]) -> float:
    wanted = set(task["FAIL_TO_PASS"]) | set(task["PASS_TO_PASS"])
    return 1.0 if not result["failed"] and set(result["passed"]) == wanted else 0.0


async def reward(task: dict[str, Any], stdout: str, exit_code: int, sandbox: Sandbox) -> float:
    """1.0 when ``coder.py`` submitted and every FAIL_TO_PASS and PASS_TO_PASS test passes, else 0.0."""
    if exit_code != 0 or not submitted(stdout):
        return 0.0
    return _resolved(task, await run_tests(task, sandbox))


async def reward_any(task: dict[str, Any], stdout: str, exit_code: int, sandbox: Sandbox) -> float:
    """For a third-party CLI (no ``submit`` marker): the final repository decides, whatever the exit code."""
    return _resolved(task, await run_tests(task, sandbox))
