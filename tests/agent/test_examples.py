"""The examples run against the real proxy (loopback) and the mock upstream: the LangGraph agent in process over its
task set, the command-line agent through ``lightning-sdk run --tasks`` (subprocess) from its YAML config and in
process from its Python definition. The mock calls the first offered tool with the question, so both agents must
score 1.0 on every task when their tools and rewards work."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import lightning_sdk.agent as la
from lightning_sdk.cli.run_cmd import read_tasks
from tests.agent.stack import ADMIN_KEY, assert_calls_traced, proxy_stack, threaded_proxy_stack
from tests.agent.test_run_cli import CLI, _env

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


async def test_langgraph_example_over_its_tasks(tmp_path: Path) -> None:
    agent = la.load_agent(str(EXAMPLES / "langgraph_agent" / "agent.py") + ":agent")
    assert isinstance(agent, la.RolloutAgent) and agent.max_attempts == 2
    tasks = read_tasks(EXAMPLES / "langgraph_agent" / "tasks.jsonl")
    async with proxy_stack(tmp_path) as st:
        summary = await la.run_tasks(agent, st.store, st.url, tasks, n_workers=4)
        assert (summary.n, summary.succeeded, summary.success_rate, summary.mean_reward) == (8, 8, 1.0, 1.0)
        for r in summary.rollouts:
            detail = await st.store.get_rollout(r.rollout_id)
            assert_calls_traced(detail, min_calls=2)


async def test_cli_example_python_definition(tmp_path: Path) -> None:
    agent = la.load_agent(str(EXAMPLES / "cli_agent" / "agent.py") + ":agent")
    assert isinstance(agent, la.CommandAgent)
    tasks = read_tasks(EXAMPLES / "cli_agent" / "tasks.jsonl")[:3]
    async with proxy_stack(tmp_path) as st:
        summary = await la.run_tasks(agent, st.store, st.url, tasks, n_workers=3)
        assert (summary.n, summary.success_rate, summary.mean_reward) == (3, 1.0, 1.0)
        for r in summary.rollouts:
            assert_calls_traced(await st.store.get_rollout(r.rollout_id), min_calls=2)


def test_cli_example_yaml_through_lightning_sdk_run(tmp_path: Path) -> None:
    summary_file = tmp_path / "summary.json"
    tasks = tmp_path / "tasks.jsonl"  # the example's first four tasks (each attempt is a Python subprocess)
    tasks.write_text("".join((EXAMPLES / "cli_agent" / "tasks.jsonl").read_text().splitlines(keepends=True)[:4]))
    with threaded_proxy_stack(tmp_path) as st:
        proc = subprocess.run(
            [*CLI, "run", str(EXAMPLES / "cli_agent" / "agent.yaml"), "--server", st.url,
             "--admin-key", ADMIN_KEY, "--tasks", str(tasks), "--workers", "4",
             "--summary", str(summary_file), "--no-progress"],
            cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        summary = json.loads(summary_file.read_text())
        assert (summary["n"], summary["success_rate"], summary["mean_reward"]) == (4, 1.0, 1.0), summary
        for a in summary["attempts"]:
            assert_calls_traced(st.server.call(st.store.get_rollout(a["rollout_id"])), min_calls=2)
