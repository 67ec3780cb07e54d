"""CommandAgent with a sandbox: the program runs in a fresh sandbox made from the task's files, the reward sees the
sandbox, and every ending (success, crash, hang, sandbox failure) leaves no sandbox and no process behind; a sandbox
failure fails the attempt (retryable) instead of scoring it 0. Real subprocesses and sandboxes."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning_sdk.agent as la
from lightning_sdk.agent._context import AttemptContext
from lightning_sdk.sandbox import Sandbox, SandboxError, SandboxLimits, SandboxSpec, get_backend

PY = sys.executable
LLM = la.LLM(base_url="http://127.0.0.1:9/v1", api_key="tok-abc", model="policy")
TASK = {"repo": {"app/main.py": "VALUE = 1\n"}, "want": "VALUE = 2\n"}


def _ctx(task: dict[str, Any]) -> AttemptContext:
    return AttemptContext("at-1", "ro-1", task, LLM, server_url="http://127.0.0.1:9")


def _spec(tmp_path: Path, **limits: Any) -> SandboxSpec:
    return SandboxSpec(limits=SandboxLimits(**limits), backend_options={"root": str(tmp_path / "boxes")})


async def _check(task: dict[str, Any], stdout: str, exit_code: int, sandbox: Sandbox) -> float:
    files = sandbox.snapshot()
    seen = json.loads(stdout)
    assert seen["cwd"] == sandbox.path and seen["key"] == "tok-abc"
    return 1.0 if files["app/main.py"] == task["want"] else 0.0


EDIT = (
    "import json, os; open('app/main.py', 'w').write('VALUE = 2\\n'); "
    "print(json.dumps({'cwd': os.getcwd(), 'key': os.environ['OPENAI_API_KEY']}))"
)


def _left(tmp_path: Path) -> list[Path]:
    root = tmp_path / "boxes"
    return list(root.iterdir()) if root.exists() else []


async def test_program_runs_in_the_sandbox_and_the_reward_reads_it(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    agent = la.CommandAgent([PY, "-c", EDIT], reward=_check, sandbox=spec, timeout=30)
    out = await agent.run_attempt(_ctx(TASK), timeout=30)
    assert out.status == "succeeded" and out.reward == 1.0
    assert spec.get_backend().active() == 0 and _left(tmp_path) == []


async def test_crash_and_hang_leave_nothing_behind(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    crash = la.CommandAgent([PY, "-c", "import sys; sys.exit('boom')"], reward=_check, sandbox=spec)
    out = await crash.run_attempt(_ctx(TASK), timeout=30)
    assert out.status == "failed" and "boom" in (out.error or "") and out.reward is None

    hang = la.CommandAgent(["bash", "-c", "sleep 300 & sleep 300"], reward=_check, sandbox=spec, kill_grace_s=0.2)
    out = await hang.run_attempt(_ctx(TASK), timeout=0.5)
    assert out.status == "timed_out"
    assert spec.get_backend().active() == 0 and _left(tmp_path) == []


async def test_sandbox_failures_fail_the_attempt_instead_of_scoring_zero(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    agent = la.CommandAgent([PY, "-c", EDIT], reward=_check, sandbox=spec)
    out = await agent.run_attempt(_ctx({"no_repo": 1}), timeout=30)  # no files to create it from
    assert out.status == "failed" and "sandbox" in (out.error or "") and out.reward is None

    out = await agent.run_attempt(_ctx({"repo": {"../outside.py": "x"}, "want": ""}), timeout=30)
    assert out.status == "failed" and "outside the sandbox" in (out.error or "")

    async def broken_verifier(task: dict[str, Any], stdout: str, code: int, sandbox: Sandbox) -> float:
        raise SandboxError("the verifier's sandbox could not start")

    agent = la.CommandAgent([PY, "-c", EDIT], reward=broken_verifier, sandbox=spec)
    out = await agent.run_attempt(_ctx(TASK), timeout=30)
    assert out.status == "failed" and "could not start" in (out.error or "") and out.reward is None
    assert spec.get_backend().active() == 0 and _left(tmp_path) == []


def test_config_section_and_backend_sharing(tmp_path: Path) -> None:
    section = {
        "command": [PY, "-c", "pass"],
        "sandbox": {"files_field": "files", "max_sandboxes": 3, "root": str(tmp_path / "b"), "limits": {"cpu_s": 5}},
    }
    agent = la.CommandAgent.from_config(section)
    assert agent.sandbox is not None and agent.sandbox.files_field == "files"
    assert agent.sandbox.limits.cpu_s == 5
    backend = agent.sandbox.get_backend()
    assert backend.max_sandboxes == 3
    assert backend is get_backend("local", max_sandboxes=3, root=str(tmp_path / "b"))  # one cap per process


def test_the_spec_summarises_what_its_sandboxes_are_held_to() -> None:
    """The run's summary reads ``SandboxSpec.summary()``: the backend's name and what its isolation enforces."""
    spec = SandboxSpec(files_field="repo")
    backend = spec.get_backend()
    summary = spec.summary()
    assert summary["backend"] == backend.name == "local"
    assert summary == {"backend": "local", **backend.describe()}
    assert summary["isolation"] == backend.describe()["isolation"]
