"""``lightning-sdk run`` as a real subprocess against a real proxy (uvicorn thread) over a SQLite store file: the
``--tasks`` evaluation mode with its summary, and graceful SIGINT in daemon mode (in-flight attempts finish)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from lightning_sdk.types import RolloutStatus
from tests.agent.stack import ADMIN_KEY, assert_calls_traced, threaded_proxy_stack
from tests.support.waiting import until

ROOT = Path(__file__).resolve().parents[2]
# ``lightning-sdk`` is ``lightning_sdk.cli:main``, which ``python -m lightning_sdk`` runs.
CLI = [sys.executable, "-m", "lightning_sdk"]

AGENT = """
import lightning_sdk.agent as la

@la.rollout(max_attempts=2)
def agent(task, llm):
    client = llm.openai_client()
    reply = client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": task["q"]}])
    if task["q"] == "crash":
        raise ValueError("this task always crashes")
    return 1.0 if task["q"].startswith("good") else 0.0

@la.rollout
def slow(task, llm):
    import os, time
    while not os.path.exists(task["gate"]):  # in flight until the test opens the gate (after its signal)
        time.sleep(0.01)
    llm.openai_client().chat.completions.create(model=llm.model, messages=[{"role": "user", "content": "hi"}])
    return 1.0
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def test_run_tasks_mode_enqueues_runs_and_summarises(tmp_path: Path) -> None:
    (tmp_path / "my_agent.py").write_text(AGENT)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps({"q": q}) for q in ["good 1", "good 2", "bad", "crash"]) + "\n")
    summary_file = tmp_path / "summary.json"
    with threaded_proxy_stack(tmp_path) as st:
        proc = subprocess.run(
            [*CLI, "run", f"{tmp_path / 'my_agent.py'}:agent", "--server", st.url,
             "--workers", "3", "--tasks", str(tasks), "--admin-key", ADMIN_KEY, "--summary", str(summary_file)],
            cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        summary = json.loads(summary_file.read_text())
        assert (summary["n"], summary["succeeded"], summary["success_rate"], summary["mean_reward"]) == (4, 3, 0.5, 0.5)
        assert [f["status"] for f in summary["failed"]] == ["failed"]
        assert "ValueError: this task always crashes" in summary["failed"][0]["error"]
        assert "success_rate=0.500" in proc.stderr and "this task always crashes" in proc.stderr
        assert "rollouts" in proc.stderr and "4/4" in proc.stderr  # the progress bar's last state
        statuses = sorted(a["status"] for a in summary["attempts"])
        assert statuses == ["failed", "failed", "succeeded", "succeeded", "succeeded"]
        for a in summary["attempts"]:
            if a["status"] == "succeeded":
                assert_calls_traced(st.server.call(st.store.get_rollout(a["rollout_id"])))

        bad = subprocess.run(
            [*CLI, "run", "no_such_module:agent", "--server", st.url, "--admin-key", "k"],
            cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert bad.returncode == 2 and "cannot import 'no_such_module'" in bad.stderr


def test_sigint_lets_in_flight_attempts_finish(tmp_path: Path) -> None:
    (tmp_path / "my_agent.py").write_text(AGENT)
    gate = tmp_path / "gate"
    with threaded_proxy_stack(tmp_path) as st:
        st.server.call(st.store.enqueue([{"q": str(i), "gate": str(gate)} for i in range(6)]))
        proc = subprocess.Popen(
            [*CLI, "run", f"{tmp_path / 'my_agent.py'}:slow", "--server", st.url,
             "--workers", "2", "--admin-key", ADMIN_KEY, "--no-progress"],
            cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            until(lambda: _running(st, proc) >= 2, timeout=60, what="two attempts running")
            proc.send_signal(signal.SIGINT)
            gate.touch()  # the two claimed attempts finish only now, after the signal
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, err
        counts = st.server.call(st.store.counts())
        assert counts.get("running", 0) == 0
        # the two claimed attempts: both finish, or (when SIGINT overtook the second claim's answer) one finishes
        # and the other is released straight back to the queue; nothing is lost either way
        done = counts.get("succeeded", 0)
        assert done in (1, 2) and counts.get("queued") == 6 - done, (counts, err)
        assert "attempts=2" in err and f"succeeded={done}" in err
        assert done == 2 or "released=1" in err
        page, _ = st.server.call(st.store.list_rollouts(status=RolloutStatus.SUCCEEDED))
        for r in page:
            assert_calls_traced(st.server.call(st.store.get_rollout(r.rollout_id)))


def test_sigterm_releases_in_flight_attempts_after_the_grace_period(tmp_path: Path) -> None:
    stuck = "\n@la.rollout\ndef stuck(task, llm):\n    __import__('time').sleep(30)\n"
    (tmp_path / "my_agent.py").write_text(AGENT + stuck)
    with threaded_proxy_stack(tmp_path) as st:
        st.server.call(st.store.enqueue([{"q": str(i)} for i in range(3)], max_attempts=1))
        proc = subprocess.Popen(
            [*CLI, "run", f"{tmp_path / 'my_agent.py'}:stuck", "--server", st.url,
             "--workers", "2", "--admin-key", ADMIN_KEY, "--no-progress", "--grace", "0.5"],
            cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            until(lambda: _running(st, proc) >= 2, timeout=60, what="two attempts running")
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, err
        assert "released=2" in err
        counts = st.server.call(st.store.counts())
        assert counts.get("queued") == 3 and counts.get("running", 0) == 0, counts
        page, _ = st.server.call(st.store.list_rollouts(status=RolloutStatus.QUEUED))
        assert [r.attempts_used for r in page] == [0, 0, 0]  # released attempts do not use up max_attempts


def _running(st: Any, proc: subprocess.Popen[str]) -> int:
    """Attempts running in the store (the CLI must still be up meanwhile)."""
    assert proc.poll() is None, proc.communicate()
    return int(st.server.call(st.store.counts()).get("running", 0))


FALLBACK_AGENT = """
import lightning_sdk.agent as la

@la.rollout
def agent(task, llm):
    client = llm.openai_client()
    client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": task["q"]}])
    return 1.0 if llm.fallback_urls == ("http://127.0.0.1:9/v1", "http://10.0.0.2:4701/v1") else 0.0
"""


def test_fallback_servers_reach_every_agents_llm(tmp_path: Path) -> None:
    """``--fallback-server`` (repeatable, a root or a ``/v1`` URL) becomes each attempt's ``LLM.fallback_urls``;
    a value that is not an http(s) URL is refused with exit 2. (The fail-over itself, across two real proxies on
    one PostgreSQL store: tests/proxy/test_many_proxies.py.)"""
    (tmp_path / "fb_agent.py").write_text(FALLBACK_AGENT)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps({"q": f"q{i}"}) for i in range(3)) + "\n")
    summary_file = tmp_path / "summary.json"
    with threaded_proxy_stack(tmp_path) as st:
        proc = subprocess.run(
            [*CLI, "run", f"{tmp_path / 'fb_agent.py'}:agent", "--server", st.url, "--workers", "2",
             "--tasks", str(tasks), "--admin-key", ADMIN_KEY, "--summary", str(summary_file),
             "--fallback-server", "http://127.0.0.1:9/", "--fallback-server", "http://10.0.0.2:4701/v1"],
            cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        summary = json.loads(summary_file.read_text())
        assert (summary["n"], summary["succeeded"], summary["mean_reward"]) == (3, 3, 1.0)
        bad = subprocess.run(
            [*CLI, "run", f"{tmp_path / 'fb_agent.py'}:agent", "--server", st.url, "--admin-key", ADMIN_KEY,
             "--fallback-server", "proxy2:4701"],
            cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert bad.returncode == 2 and "'proxy2:4701' is not an http(s) URL" in bad.stderr
