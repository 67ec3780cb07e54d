"""``lightning-sdk daemon --ray ADDRESS`` on a real multi-node Ray cluster on this machine (marker ``ray_cluster``).

The cluster: a head (2 CPUs; a ``cpu_node`` resource for the proxy actor, a ``trainer`` one for the learner actor)
and two nodes with a custom ``gpu_like`` resource standing in for a GPU (1 CPU each), each a ``ray start`` process
of its own (tests/support/ray_cluster.py). The daemon (a subprocess: its own proxy and the training loop, on a real
PostgreSQL store the proxy actor shares) places its engine as a Ray actor on a ``gpu_like`` node, the learner and a
proxy actor on the head and two worker actors running the calc example's agent against that proxy. After the first
step, the node that hosts the engine is killed (SIGKILL of its raylet and workers: a machine failing), and so are the
proxy and the learner actors' processes. Ray restarts each: the engine on the other ``gpu_like`` node (the calls it
was serving are re-sent with the served weights), the learner (it resumes from the last step's state), the proxy (on
its host and port; meanwhile the agents fail over to the daemon's proxy); the attempts of any worker on the dead node
lose their lease and are retried, and the run finishes: every step trained, no group or attempt trained twice, every
trained attempt's calls whole and chained.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lightning_sdk.store import open_store, run_sync
from lightning_sdk.types import AttemptStatus
from tests.support.ray_cluster import RayCluster
from tests.support.waiting import until
from tests.trainer.tiny import CLI, ROOT, build_small_policy, write_config

pytestmark = [pytest.mark.ray_cluster, pytest.mark.timeout(500)]

STEPS = 4
#: the run's own bound (the pytest timeout above leaves room for the diagnosis and the cluster's stop)
RUN_S = 420.0


def _wait(what: str, ready: Callable[[], object], proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    def held() -> bool:
        assert proc.poll() is None, f"the daemon exited while waiting for {what}:\n{log.read_text()[-4000:]}"
        return bool(ready())

    try:
        until(held, timeout=timeout, what=what, every=0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}:\n{log.read_text()[-4000:]}") from None


def _stuck(proc: subprocess.Popen[bytes], cluster: RayCluster, log: Path, out: Path) -> str:
    """Where a stuck run waits: the daemon's threads and asyncio tasks (``kill -USR1``: ``app/daemon.py``) and the
    actors' stacks (py-spy); the Ray logs are kept in ``out/ray-logs``, all of it in ``out/stuck.txt``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGUSR1)
        with contextlib.suppress(AssertionError):  # a daemon that cannot dump: what its log has is kept anyway
            until(lambda: "asyncio tasks ---" in log.read_text(errors="replace"), timeout=20, every=0.2)
    tail = log.read_text(errors="replace")[-30000:]
    text = f"--- daemon log (tail) ---\n{tail}\n--- actors ---\n{cluster.diagnose()}"
    cluster.save_logs(out / "ray-logs")
    (out / "stuck.txt").write_text(text)
    return text


def _metric(url: str, name: str, **labels: str) -> float:
    """One family's value from a real scrape of ``url``/metrics, parsed by prometheus_client's parser."""
    text = httpx.get(url + "/metrics", timeout=30).text
    want = set(labels.items())
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and want <= set(s.labels.items())
    )


def _steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    return sum(1 for line in path.read_text().splitlines() if line.strip()) if path.exists() else 0


def test_daemon_on_a_ray_cluster_survives_losing_the_engines_node(tmp_path: Path, postgres_url: str) -> None:
    t0 = time.monotonic()
    policy = build_small_policy(tmp_path / "policy", hidden=32, layers=2)
    config = write_config(
        tmp_path / "daemon.toml",
        str(policy),
        warm_start={"enabled": False},
        store={"url": postgres_url},
        rl={"steps": STEPS, "tasks_per_step": 2, "samples_per_task": 2, "max_tokens": 16, "drop_zero_variance": False,
            "max_staleness": 2},
        cluster={"engine_resource": "gpu_like", "engine_cpus": 0, "engine_threads": 1, "workers": 2,
                 "worker_concurrency": 4, "worker_cpus": 1, "lease_s": 8, "max_attempts": 4, "proxies": 1,
                 "proxy_resource": "cpu_node", "proxy_cpus": 0, "learner_resource": "trainer", "learner_cpus": 0},
    )  # fmt: skip
    run = tmp_path / "run"
    log = tmp_path / "daemon.log"
    with RayCluster(tmp_path, head_cpus=2, head_resources={"cpu_node": 1, "trainer": 1}) as cluster:
        nodes = [cluster.add_node(num_cpus=1, resources={"gpu_like": 1}) for _ in range(2)]
        cluster.wait_for_nodes(3)
        t_cluster = time.monotonic() - t0
        env = {**cluster.env, "PYTHONPATH": str(ROOT), "LIGHTNING_SDK_LOG_LEVEL": "WARNING"}
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-c", CLI, "daemon", "--config", str(config), "--output", str(run),
                 "--ray", cluster.address],
                cwd=str(ROOT), env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            # the kills come as soon as the proxy actor has answered its first calls: well before the last step
            # (killed after it, nothing would be tested; checked below)
            _wait("the placements", lambda: (run / "cluster.json").exists(), proc, log, timeout=240)
            placed = json.loads((run / "cluster.json").read_text())["parts"]
            engine = next(p for p in placed if p["part"] == "engine-0")
            proxy = next(p for p in placed if p["part"] == "proxy-0")
            learner = next(p for p in placed if p["part"] == "learner")
            assert proxy["pid"] in cluster.nodes[0].pids()  # the proxy actor runs on the CPU node (the head)
            # the learner is an actor of its own on the node with the "trainer" resource, not the daemon
            assert learner["pid"] in cluster.nodes[0].pids() and learner["pid"] != proc.pid
            daemon_url = json.loads((run / "daemon.json").read_text())["url"]
            # the worker actors call the proxy actor: it served the calls, the daemon's own proxy none
            served = lambda: _metric(proxy["url"], "lightning_sdk_calls_total", status="200") > 0  # noqa: E731
            _wait("the proxy actor's first calls", served, proc, log, timeout=180)
            assert _metric(daemon_url, "lightning_sdk_calls_total") == 0
            host = next(n for n in nodes if engine["pid"] in n.pids())  # the node whose raylet runs the engine
            t_kill = time.monotonic()
            steps_at_kill = _steps(run)
            assert steps_at_kill < STEPS, "the run had ended before the kills: nothing was tested"
            killed = cluster.kill_node(host)  # the engine's node, then the proxy and the learner actors
            os.kill(proxy["pid"], signal.SIGKILL)
            os.kill(learner["pid"], signal.SIGKILL)
            assert engine["pid"] in killed
            proc.wait(timeout=max(10.0, RUN_S - (time.monotonic() - t0)))
        except (AssertionError, subprocess.TimeoutExpired) as exc:
            raise AssertionError(f"{exc}\n{_stuck(proc, cluster, log, tmp_path)[-12000:]}") from exc
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        wall = time.monotonic() - t0
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == STEPS
    events = summary["cluster"]["engine_events"]
    restarted = [e for e in events if e["event"] == "restarted"]
    assert restarted and restarted[0]["old_pid"] == engine["pid"] and restarted[0]["pid"] != engine["pid"]
    assert restarted[0]["node_id"] != engine["node_id"]  # moved to the other gpu_like node
    # the learner actor was restarted and resumed from the last step's state: every step trained, in the actor
    back = summary["cluster"]["learner_events"]
    assert back and back[0]["event"] == "restarted" and back[0]["old_pid"] == learner["pid"], back
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trained_steps = sum(1 for row in rows if row["records"] > 0)  # a step without records does not step the learner
    assert summary["cluster"]["learner_steps"] == trained_steps
    final = {p["part"]: p for p in summary["cluster"]["placements"]}
    assert summary["cluster"]["placements_error"] is None  # asked again once every engine was back
    assert final["learner"]["pid"] not in (learner["pid"], proc.pid) and final["learner"]["steps"] == trained_steps
    assert final["proxy-0"]["pid"] != proxy["pid"]  # Ray restarted the proxy actor (same host and port)
    # the learner's weights reached every engine: each serves the last step's version
    assert [e["version"] for e in summary["cluster"]["engines"]] == [rows[-1]["version"]]
    print(
        f"\ncluster up {t_cluster:.0f} s; run {wall - t_cluster:.0f} s after it; killed {host.name} "
        f"({len(killed)} processes) {t_kill - t0:.0f} s in, after {steps_at_kill} steps; engine events {events}; "
        f"re-sent calls {summary['cluster']['engine_resent_calls']}; workers {summary['cluster']['workers']}"
    )

    # nothing lost, nothing twice: each trained group consumed once, by one step; each trained rollout has exactly
    # one succeeded attempt, and that attempt's calls are whole (ids and log-probs of equal length, seq 0..n-1)
    store = open_store(postgres_url)
    try:
        groups, _ = run_sync(store.list_group_details(split="train", limit=1000))
    finally:
        run_sync(store.close())
    consumed = {g.group.group_id: g.group.consumed_step for g in groups if g.group.consumed_step is not None}
    trained = [g for g in groups if g.group.group_id in consumed]
    assert len({consumed[g.group.group_id] for g in trained}) == STEPS
    cut_off = 0
    broken: list[str] = []
    gaps = 0
    call_ids: list[str] = []
    for g in trained:
        for detail in g.rollouts:
            ok = [a for a in detail.attempts if a.attempt.status is AttemptStatus.SUCCEEDED]
            assert len(ok) <= 1, f"rollout {detail.rollout.rollout_id} has {len(ok)} succeeded attempts"
            cut_off += sum(1 for a in detail.attempts if a.attempt.status is AttemptStatus.TIMED_OUT)
            for a in ok:
                # seq is unique and increasing; with a shared store it may skip one a dead proxy had reserved for a
                # call it never answered (the agent sent that call again to the other proxy)
                seqs = [c.seq for c in a.calls]
                assert a.calls and seqs == sorted(set(seqs)), seqs
                gaps += seqs[-1] + 1 - len(seqs)
                for c in a.calls:
                    assert c.error is None and c.prompt_ids and len(c.completion_ids) == len(c.logprobs) > 0
                # no call lost or recorded twice (a proxy killed between answering and recording one, or a call
                # re-sent to the other proxy after the first had recorded it): each turn's prompt extends the last
                # turn's prompt + completion, as the agent sent it
                for prev, c in zip(a.calls, a.calls[1:], strict=False):
                    whole = list(prev.prompt_ids) + list(prev.completion_ids)
                    if list(c.prompt_ids[: len(whole)]) != whole:
                        broken.append(f"{a.attempt.attempt_id} seq {prev.seq}->{c.seq}")
                call_ids.extend(c.call_id for c in a.calls)
    assert not broken, f"calls of a trained attempt that do not extend the previous turn: {broken}"
    assert len(call_ids) == len(set(call_ids))
    print(
        f"trained groups {len(trained)}; attempts cut off by the kill and retried: {cut_off}; "
        f"learner events {back}; final placements {final}"
    )
