"""The coding example end to end against a scripted upstream: ``coder.py`` (a real subprocess in a real sandbox)
talks to the real proxy (loopback) in front of the mock OpenAI server, which scripts the episode: grep, sed, submit.
The verifier scores it on a fresh sandbox; the calls are traced with exact ids; nothing is left behind. Then the
failure paths: a wrong fix scores 0, a model that never submits scores 0, a hanging tool command is cut off, a
harness that crashes is retried and only its successful attempt is trained, a harness that hangs is killed at the
agent's timeout (its processes and sandbox gone)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import lightning_sdk.agent as la
from lightning_sdk.records import build_records
from lightning_sdk.sandbox import SandboxLimits, SandboxSpec
from lightning_sdk.store.loader import load_groups
from lightning_sdk.types import AttemptStatus
from tests.agent.stack import assert_calls_traced, proxy_stack
from tests.support.mock_openai import MockOpenAI, MockReply
from tests.support.sandboxes import sandboxed_processes

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "coding_agent"
sys.path.insert(0, str(EXAMPLE))

import tasks as T  # noqa: E402


def _agent(tmp_path: Path, timeout: float = 60, max_attempts: int = 1) -> la.CommandAgent:
    example = la.load_agent(f"{EXAMPLE / 'agent.py'}:agent")
    assert isinstance(example, la.CommandAgent) and example.sandbox is not None
    spec = SandboxSpec(limits=SandboxLimits(wall_s=60), backend_options={"root": str(tmp_path / "boxes")})
    return la.CommandAgent(
        example.command, reward=example.reward, timeout=timeout, sandbox=spec, name="coder", max_attempts=max_attempts
    )


def _script(fixes: dict[str, str], *, never_submit: bool = False, hang: bool = False) -> Any:
    """An upstream playing the demonstration: grep the failing function, apply ``fixes[function]``, submit."""

    def reply(body: dict[str, Any]) -> MockReply:
        messages = body["messages"]
        assert [t["function"]["name"] for t in body["tools"]] == ["bash", "submit"]
        issue = messages[1]["content"]
        function = issue.split("\n", 1)[0].split("::test_", 1)[1].rsplit("_", 1)[0]
        tool_turns = sum(m["role"] == "tool" for m in messages)
        if tool_turns == 0:
            cmd = "sleep 30" if hang else f"grep -r -A5 'def {function}' mathkit"
            return MockReply(tool_calls=[{"name": "bash", "arguments": json.dumps({"cmd": cmd})}])
        if tool_turns == 1:
            return MockReply(tool_calls=[{"name": "bash", "arguments": json.dumps({"cmd": fixes[function]})}])
        if never_submit:
            return MockReply(text="I am done.")
        return MockReply(tool_calls=[{"name": "submit", "arguments": "{}"}])

    return reply


async def test_scripted_episodes_are_verified_traced_and_cleaned_up(tmp_path: Path) -> None:
    pairs = T.make_tasks_with_fixes("heldout", 4, seed=21)
    tasks = [t for t, _ in pairs]
    good = {t["function"]: T.fix_command(t, f) for t, f in pairs[:2]}
    wrong = {t["function"]: f"sed -i '1s/def/def/' {t['path']}" for t, _ in pairs[2:]}
    mock = MockOpenAI(reply=_script({**good, **wrong}))
    agent = _agent(tmp_path)
    async with proxy_stack(tmp_path, mock) as st:
        summary = await la.run_tasks(agent, st.store, st.url, tasks, n_workers=4)
        rewards = {r.task["function"]: r.reward for r in summary.rollouts}
        assert rewards == {**dict.fromkeys(good, 1.0), **dict.fromkeys(wrong, 0.0)}
        for r in summary.rollouts:
            assert_calls_traced(await st.store.get_rollout(r.rollout_id), min_calls=3)
        # the tool outputs the model saw: the real grep output of the sandbox, "(no output)" after sed
        seen = {b["messages"][3]["content"] for b in mock.requests if len(b["messages"]) == 4}
        assert seen == {T.grep_output(t) for t in tasks}
        assert {b["messages"][5]["content"] for b in mock.requests if len(b["messages"]) == 6} == {"(no output)"}
    assert agent.sandbox is not None and agent.sandbox.get_backend().active() == 0
    assert not any((tmp_path / "boxes").iterdir())


async def test_no_submit_scores_zero_and_a_hanging_command_is_cut_off(tmp_path: Path) -> None:
    pairs = T.make_tasks_with_fixes("heldout", 2, seed=22)
    fixes = {t["function"]: T.fix_command(t, f) for t, f in pairs}
    agent = _agent(tmp_path)
    async with proxy_stack(tmp_path, MockOpenAI(reply=_script(fixes, never_submit=True))) as st:
        summary = await la.run_tasks(agent, st.store, st.url, [pairs[0][0]], n_workers=1)
        assert [r.reward for r in summary.rollouts] == [0.0]
    hang_agent = la.CommandAgent(
        [*agent.command, "--cmd-timeout", "0.5"], reward=agent.reward, timeout=60, sandbox=agent.sandbox
    )
    mock = MockOpenAI(reply=_script(fixes, hang=True))
    async with proxy_stack(tmp_path / "2", mock) as st:
        summary = await la.run_tasks(hang_agent, st.store, st.url, [pairs[1][0]], n_workers=1)
        assert [r.reward for r in summary.rollouts] == [1.0]  # the fix still landed after the cut-off command
        assert "(killed after 0.5 s)" in mock.requests[1]["messages"][3]["content"]
    assert not any((tmp_path / "boxes").iterdir())


async def test_a_crashing_harness_is_retried_and_only_its_successful_attempt_is_trained(tmp_path: Path) -> None:
    """The first episode's second command kills ``coder.py`` (SIGKILL of its parent from the tool's shell) after two
    traced calls: the attempt fails, the retry plays the episode through, and the records train only the retry."""
    pairs = T.make_tasks_with_fixes("heldout", 2, seed=23)
    fixes = {t["function"]: T.fix_command(t, f) for t, f in pairs}
    played = _script(fixes)
    crashed: set[str] = set()

    def reply(body: dict[str, Any]) -> MockReply:
        function = body["messages"][1]["content"].split("\n", 1)[0].split("::test_", 1)[1].rsplit("_", 1)[0]
        if sum(m["role"] == "tool" for m in body["messages"]) == 1 and function not in crashed:
            crashed.add(function)
            return MockReply(tool_calls=[{"name": "bash", "arguments": json.dumps({"cmd": "kill -9 $PPID"})}])
        return played(body)

    agent = _agent(tmp_path, max_attempts=2)
    async with proxy_stack(tmp_path, MockOpenAI(reply=reply)) as st:
        summary = await la.run_tasks(agent, st.store, st.url, [t for t, _ in pairs], n_workers=2)
        assert crashed == set(fixes)
        assert [r.reward for r in summary.rollouts] == [1.0, 1.0]
        succeeded = {}
        for r in summary.rollouts:
            detail = await st.store.get_rollout(r.rollout_id)
            failed, ok = detail.attempts
            assert (failed.attempt.status, ok.attempt.status) == (AttemptStatus.FAILED, AttemptStatus.SUCCEEDED)
            assert (failed.attempt.error or "").startswith("coder exited with code -9")  # SIGKILL
            assert len(failed.calls) == 2 and len(ok.calls) == 3  # the crashed attempt's calls stay, under it
            succeeded[r.rollout_id] = ok
        built = build_records(await load_groups(st.store, split=summary.split))
        assert {rep.rollout_id: rep.attempt_id for rep in built.reports} == {
            rid: ok.attempt.attempt_id for rid, ok in succeeded.items()
        }
        assert {rec.attempt_id for rec in built.records} == {ok.attempt.attempt_id for ok in succeeded.values()}
        completions = {tuple(c.completion_ids) for ok in succeeded.values() for c in ok.calls}
        for rec in built.records:  # each row ends with a sampled completion of the successful attempt
            ids = [int(i) for i in rec.segment.input_ids]
            assert any(len(c) and tuple(ids[-len(c) :]) == c for c in completions)
        assert sum(int(rec.segment.loss_mask.sum()) for rec in built.records) == sum(
            len(c.completion_ids) for ok in succeeded.values() for c in ok.calls
        )  # every trained token is one the retry sampled; none of the crashed attempts' tokens
    assert not any((tmp_path / "boxes").iterdir())


async def test_a_hanging_harness_is_killed_at_the_agent_timeout(tmp_path: Path) -> None:
    """The model endpoint never answers (the mock sleeps 60 s), so ``coder.py`` waits on its first call: the command
    agent kills the harness's process group at its 2 s timeout; no process of the sandbox and no sandbox is left."""
    pairs = T.make_tasks_with_fixes("heldout", 1, seed=24)
    agent = _agent(tmp_path, timeout=2)
    async with proxy_stack(tmp_path, MockOpenAI(delay_s=60)) as st:
        t0 = time.monotonic()
        summary = await la.run_tasks(agent, st.store, st.url, [pairs[0][0]], n_workers=1)
        took = time.monotonic() - t0
        assert summary.rollouts[0].status == "failed" and "timed out after 2" in (summary.rollouts[0].error or "")
        detail = await st.store.get_rollout(summary.rollouts[0].rollout_id)
        assert [(a.attempt.status, "timed out" in (a.attempt.error or "")) for a in detail.attempts] == [
            (AttemptStatus.FAILED, True)
        ]
        assert took < 30  # killed at the timeout, not at the mock's 60 s
        assert sandboxed_processes(tmp_path / "boxes") == set()
    assert not any((tmp_path / "boxes").iterdir())


def test_gpu_recipe_and_third_party_agent_load() -> None:
    """The README's GPU config validates (verl + launched vLLM servers) and both of its agents load."""
    from lightning_sdk.trainer.config import load_train_config

    config = load_train_config(EXAMPLE / "train_gpu.toml")
    assert (config.backend, config.engine.kind, config.engine.launch) == ("verl", "vllm", True)
    assert config.verl.n_gpus == 4 and config.verl.lr == 1.0e-6 and config.engine.gpus == [[4], [5], [6], [7]]
    gpu = la.load_agent(f"{EXAMPLE / 'agent_gpu.py'}:agent")
    mini = la.load_agent(f"{EXAMPLE / 'agent_mini.py'}:agent")
    assert isinstance(gpu, la.CommandAgent) and isinstance(mini, la.CommandAgent)
    assert gpu.sandbox is not None and gpu.sandbox.limits.wall_s == 900
    assert mini.command[:4] == ["mini", "-y", "-m", "openai/policy"] and mini.fail_on_error is False
    overridden = load_train_config(EXAMPLE / "train_gpu.toml", {"agent": "agent_mini.py:agent"})
    assert overridden.agent == f"{EXAMPLE / 'agent_mini.py'}:agent"  # resolved against the config's directory
