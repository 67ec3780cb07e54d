"""The reward: after the agent submits, run FAIL_TO_PASS and PASS_TO_PASS in a fresh sandbox.

The fresh sandbox holds the agent's final repository (its snapshot, any ``tests/`` it wrote dropped) plus the hidden
tests (``tasks.hidden_tests``) and a small runner; the tests run with no network under the sandbox's limits. 1.0
when every listed test passes, else 0.0 (also when the agent never submitted, broke the import or made a test hang).
A sandbox that cannot be created or run raises ``SandboxError``: the attempt fails and is retried, never scored 0.

Per-turn rewards (opt-in: ``reward_turns``, used by ``agent_turns.py``): after a submitted episode the verifier
replays the harness's ``bash`` commands, read from the attempt's calls in order, in a fresh sandbox holding the
task's original repository. After each call's commands, if the code changed, it runs FAIL_TO_PASS + PASS_TO_PASS
on a copy (as above; a state equal to the final repository reuses the final run). A state's progress is the
number of FAIL_TO_PASS tests passing, 0 while any PASS_TO_PASS test fails; a call after which progress is higher
than after every earlier call gets ``emit_reward(gain / len(FAIL_TO_PASS), "tests_fixed", call_id=...)``, so the
per-call rewards of an episode sum to at most 1.0 (1.0 when it resolves the task). The final reward stays 1.0 /
0.0.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from tasks import hidden_tests

import lightning_sdk as ls
from lightning_sdk.sandbox import Sandbox
from lightning_sdk.types import Call

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
REPLAY_CMD_TIMEOUT_S = 10.0  # coder.py's --cmd-timeout
TURN_REWARD = "tests_fixed"  # the name of the per-call rewards
# each replayed command runs as coder.py runs it, ``bash -c CMD`` under a parent of its own that is not the worker:
# ``$PPID`` there is a throwaway ``sh`` (in coder.py it is coder.py), never the trainer (``exit`` keeps sh from
# exec'ing bash in its place)
REPLAY_SHELL = ["sh", "-c", 'bash -c "$1"; exit $?', "replay"]


def submitted(stdout: str) -> bool:
    lines = stdout.strip().splitlines()
    try:
        return bool(lines and json.loads(lines[-1]).get("submitted"))
    except (ValueError, AttributeError):
        return False


async def run_tests(task: dict[str, Any], sandbox: Sandbox) -> dict[str, Any]:
    """Run the task's FAIL_TO_PASS + PASS_TO_PASS on a fresh copy of ``sandbox``: ``{"passed", "failed"}``."""
    files = _code(sandbox.snapshot())
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


def _code(snapshot: dict[str, str]) -> dict[str, str]:
    """The files of a snapshot that the tests see (any ``tests/`` the agent wrote dropped)."""
    return {p: t for p, t in snapshot.items() if not p.startswith("tests/") and p != "_run_tests.py"}


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


def bash_commands(call: Call) -> tuple[list[str], bool]:
    """The ``bash`` commands ``coder.py`` ran for one call, in order, and whether the call submitted (coder.py
    runs a call's tool calls in order and stops at ``submit``)."""
    try:
        tool_calls = call.response["choices"][0]["message"].get("tool_calls") or []
    except (KeyError, IndexError, TypeError, AttributeError):
        return [], False
    commands: list[str] = []
    for tc in tool_calls:
        function = tc.get("function") or {}
        if function.get("name") == "submit":
            return commands, True
        try:
            args = json.loads(function.get("arguments") or "{}")
        except (json.JSONDecodeError, TypeError):
            continue
        if function.get("name") == "bash" and isinstance(args, dict) and isinstance(args.get("cmd"), str):
            commands.append(args["cmd"])
    return commands, False


def progress(task: dict[str, Any], result: dict[str, Any]) -> int:
    """How many FAIL_TO_PASS tests pass, counted only while every PASS_TO_PASS test passes (0 otherwise): a fix
    that breaks other code is no progress, and a resolved repository has progress ``len(FAIL_TO_PASS)``."""
    passed = set(result["passed"])
    if not set(task["PASS_TO_PASS"]) <= passed:
        return 0
    return len(set(task["FAIL_TO_PASS"]) & passed)


async def turn_rewards(
    task: dict[str, Any], calls: list[Call], sandbox: Sandbox, final: dict[str, Any] | None = None
) -> dict[str, float]:
    """Replay the calls' commands on the task's original repository (a fresh sandbox); ``{call_id: reward}`` for
    each call after which the repository's ``progress`` is higher than after every earlier call (the gain, as a
    share of FAIL_TO_PASS). ``final``: the test result of the attempt's final repository, reused for a replayed
    state equal to it."""
    wanted = task["FAIL_TO_PASS"]
    final_code = _code(sandbox.snapshot()) if final is not None else None
    out: dict[str, float] = {}
    best = 0  # FAIL_TO_PASS tests fail on the task's repository by construction (tasks.py)
    async with await sandbox.fresh(task["repo"]) as replay:
        code = _code(replay.snapshot())
        for call in calls:
            if call.error is not None:
                continue
            commands, submits = bash_commands(call)
            for cmd in commands:
                await replay.exec([*REPLAY_SHELL, cmd], timeout=REPLAY_CMD_TIMEOUT_S)
            now = _code(replay.snapshot()) if commands else code
            if now != code:
                code = now
                result = final if final is not None and now == final_code else await run_tests(task, replay)
                passing = progress(task, result)
                if passing > best:
                    out[call.call_id] = (passing - best) / len(wanted)
                    best = passing
            if submits:
                break
    return out


async def reward_turns(
    task: dict[str, Any], stdout: str, exit_code: int, sandbox: Sandbox, *, calls: list[Call]
) -> float:
    """``reward`` plus per-call rewards (``turn_rewards``) emitted for a submitted episode's calls."""
    if exit_code != 0 or not submitted(stdout):
        return 0.0
    final = await run_tests(task, sandbox)
    for call_id, value in (await turn_rewards(task, calls, sandbox, final)).items():
        ls.emit_reward(value, TURN_REWARD, call_id=call_id)
    return _resolved(task, final)
