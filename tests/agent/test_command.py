"""CommandAgent: placeholders, the environment a program gets, rewards from its output, failures, and timeouts that
kill the whole process group (real subprocesses)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

import lightning_sdk.agent as la
from lightning_sdk.agent._context import AttemptContext
from lightning_sdk.errors import ConfigError
from tests.support.waiting import until

LLM = la.LLM(base_url="http://127.0.0.1:9/v1", api_key="tok-abc", model="policy")
PY = sys.executable

PRINT_ENV = (
    "import json, os, sys; "
    "keys = ['OPENAI_BASE_URL','OPENAI_API_BASE','OPENAI_API_KEY','OPENAI_MODEL','LITELLM_PROXY_API_BASE',"
    "'LITELLM_PROXY_API_KEY','LIGHTNING_SDK_TASK','LIGHTNING_SDK_ATTEMPT_ID','LIGHTNING_SDK_REWARD_URL','MY_FLAG']; "
    "print(json.dumps({'argv': sys.argv[1:], 'env': {k: os.environ.get(k) for k in keys}, "
    "'file': json.load(open(sys.argv[-1]))}))"
)


def _ctx(task: dict[str, object]) -> AttemptContext:
    return AttemptContext("at-9", "ro-9", task, LLM, server_url="http://127.0.0.1:9")


def _parse(task: dict[str, object], stdout: str, code: int) -> float:
    return float(json.loads(stdout)["argv"][1] == str(task["answer"]))


async def test_placeholders_env_and_reward_function() -> None:
    agent = la.CommandAgent(
        [PY, "-c", PRINT_ENV, "{task[question]}", "{task[answer]}", "{task[meta]}", "{task}", "{x}", "{task_file}"],
        reward=_parse,
        env={"MY_FLAG": "1", "OPENAI_API_KEY": "overridden-by-the-attempt"},
    )
    task: dict[str, object] = {"question": "2 + 2 = ?", "answer": 4, "meta": {"k": [1, 2]}}
    out = await agent.run_attempt(_ctx(task), timeout=30)
    assert out.status == "succeeded" and out.reward == 1.0
    seen = json.loads(out.output or "")
    assert seen["argv"][:4] == ["2 + 2 = ?", "4", '{"k": [1, 2]}', json.dumps(task)]
    assert seen["argv"][4] == "{x}"
    assert seen["file"] == task
    assert seen["env"] == {
        "OPENAI_BASE_URL": "http://127.0.0.1:9/v1",
        "OPENAI_API_BASE": "http://127.0.0.1:9/v1",
        "OPENAI_API_KEY": "tok-abc",
        "OPENAI_MODEL": "policy",
        "LITELLM_PROXY_API_BASE": "http://127.0.0.1:9/v1",
        "LITELLM_PROXY_API_KEY": "tok-abc",
        "LIGHTNING_SDK_TASK": json.dumps(task),
        "LIGHTNING_SDK_ATTEMPT_ID": "at-9",
        "LIGHTNING_SDK_REWARD_URL": "http://127.0.0.1:9/lightning/v1/reward",
        "MY_FLAG": "1",
    }


async def test_nonzero_exit_fails_with_stderr_tail_unless_scored() -> None:
    script = "import sys; print('partial'); sys.stderr.write('the agent gave up\\n'); sys.exit(3)"
    failing = la.CommandAgent([PY, "-c", script])
    out = await failing.run_attempt(_ctx({}), timeout=30)
    assert out.status == "failed"
    assert out.error is not None and "exited with code 3" in out.error and "the agent gave up" in out.error

    scored = la.CommandAgent([PY, "-c", script], reward=lambda t, so, code: -1.0 * code, fail_on_error=False)
    out = await scored.run_attempt(_ctx({}), timeout=30)
    assert (out.status, out.reward) == ("succeeded", -3.0)

    missing = la.CommandAgent(["/no/such/program-xyz"])
    out = await missing.run_attempt(_ctx({}), timeout=30)
    assert out.status == "failed" and "cannot start" in (out.error or "")

    with pytest.raises(ConfigError, match="does not have"):
        la.CommandAgent([PY, "{task[nope]}"]).render_args({"q": 1})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0): read its state
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


async def test_timeout_kills_the_whole_process_group(tmp_path: Path) -> None:
    """The program starts a grandchild that would sleep for a minute, then hangs; on timeout both must die."""
    pidfile = tmp_path / "grandchild.pid"
    script = (
        "import subprocess, sys, time; "
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pidfile)!r}, 'w').write(str(p.pid)); print('started', flush=True); time.sleep(60)"
    )
    agent = la.CommandAgent([PY, "-c", script], kill_grace_s=0.5)
    t0 = time.monotonic()
    out = await agent.run_attempt(_ctx({}), timeout=1.5)
    elapsed = time.monotonic() - t0
    assert out.status == "timed_out" and "timed out after 1.5 s" in (out.error or "")
    grandchild = int(pidfile.read_text())
    until(lambda: not _alive(grandchild), timeout=5, what="the grandchild to die")
    print(f"timeout to kill: {elapsed:.2f} s")


def test_from_config_and_load_agent(tmp_path: Path) -> None:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(
        "agent:\n"
        f"  command: {PY} -c 'print(1)' --q '{{task[q]}}'\n"
        "  reward: tests.agent.test_command:_parse\n"
        "  timeout: 12\n"
        "  max_attempts: 3\n"
        "  env: {A: 1}\n"
    )
    agent = la.load_agent(str(cfg))
    assert isinstance(agent, la.CommandAgent)
    assert agent.command == [PY, "-c", "print(1)", "--q", "{task[q]}"]
    assert (agent.timeout, agent.max_attempts, agent.env, agent.reward) == (12, 3, {"A": "1"}, _parse)
    assert agent.render_args({"q": "hi"}) == [PY, "-c", "print(1)", "--q", "hi"]
    with pytest.raises(ConfigError, match="unknown command agent keys"):
        la.agent_from_config({"command": "x", "rewrd": "y"})

    module = tmp_path / "my_agent.py"
    module.write_text("def agent(task, llm):\n    return 1.0\n")
    loaded = la.load_agent(f"{module}:agent")
    assert isinstance(loaded, la.RolloutAgent) and loaded({}, LLM) == 1.0
    assert la.load_agent("tests.agent.test_command:_parse") is not None
    with pytest.raises(ConfigError, match="has no"):
        la.load_agent(f"{module}:nope")


def test_plain_call_runs_the_program_once() -> None:
    agent = la.CommandAgent([PY, "-c", PRINT_ENV, "{task[question]}", "{task[answer]}", "{task_file}"], reward=_parse)
    assert agent({"question": "q", "answer": 4}, LLM) == 1.0  # the program echoes the answer: argv[1] == "4"
    swapped = la.CommandAgent([PY, "-c", PRINT_ENV, "{task[answer]}", "{task[question]}", "{task_file}"], reward=_parse)
    assert swapped({"question": "q", "answer": 4}, LLM) == 0.0
