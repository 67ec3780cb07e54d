"""``lightning-sdk train`` end to end (small settings) and the daemon's exactly-once resume after SIGKILL.

Both run the real command in a subprocess: SQLite store, proxy on a loopback port, embedded engine, the calc
example's OpenAI-SDK agent in process, learner, checkpoints.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_sdk.trainer.checkpoint import load_checkpoint
from tests.support.waiting import until
from tests.trainer.tiny import CLI, EXAMPLE, ROOT, build_small_policy
from tests.trainer.tiny import write_config as _write_config


def _train(config: Path, out: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LIGHTNING_SDK_LOG_LEVEL": "WARNING"}
    return subprocess.Popen(
        # the console script's own entry (lightning_sdk.cli.main: its malloc settings and OpenMP waits included)
        [sys.executable, "-m", "lightning_sdk", "train", str(config), "--output", str(out)],
        cwd=str(ROOT),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _train_to_end(config: Path, out: Path) -> tuple[dict[str, Any], str]:
    """Run ``lightning-sdk train`` to its end (4 min at most); it must exit 0. Its summary and its output."""
    proc = _train(config, out)
    stdout, _ = proc.communicate(timeout=240)
    text = stdout.decode()
    assert proc.returncode == 0, text[-3000:]
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return summary, text


@pytest.fixture(scope="module")
def small_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_small_policy(tmp_path_factory.mktemp("policy") / "tiny", hidden=32, layers=2)


def test_train_end_to_end_writes_the_summary(tmp_path: Path, small_policy: Path) -> None:
    config = _write_config(
        tmp_path / "train.toml",
        str(small_policy),
        warm_start={
            "enabled": True,
            "max_steps": 4,
            "eval_every": 2,
            "eval_below_loss": 100.0,
            "target_success": 1.0,
            "batch_size": 8,
            "validation_tasks": 8,
        },
        # every group trained (advantage 0 where rewards agree), so each step measures the learner for the balance
        rl={
            "steps": 4,
            "tasks_per_step": 4,
            "samples_per_task": 2,
            "workers": 8,
            "max_tokens": 24,
            "drop_zero_variance": False,
        },
        eval={"n": 12, "max_tokens": 24, "workers": 12},
    )
    out = tmp_path / "run"
    summary, stdout = _train_to_end(config, out)
    for key in ("eval_before", "eval_after"):
        assert set(summary[key]) >= {"success_rate", "mean_reward", "n"}
        assert summary[key]["n"] == 12
        assert 0.0 <= summary[key]["success_rate"] <= 1.0
    assert summary["steps"] == 4
    assert summary["wall_s"] > 0
    assert summary["eval_sampling"] == {"temperature": 0.0, "max_tokens": 24}
    assert summary["warm_start"]["steps"] == 4
    # a small policy's process (lightning_sdk/memory.py): its step tensors from the heap (8 MiB threshold), the freed
    # heap given back after the warm start and after each of the 4 learner steps (and by the resident-size guard
    # above 1.2 GB, which this small job never reaches)
    malloc = summary["malloc"]
    assert malloc["small_policy"] is True and malloc["mmap_threshold"] == 8 << 20
    assert malloc["trims"] == 1 + 4 and malloc["guard_trims"] == 0 and malloc["released_mb"] >= 0
    model_dir = Path(summary["model_dir"])
    assert (model_dir / "config.json").exists() and (model_dir / "tokenizer.json").exists()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["groups"] == 4 for r in rows)
    # the engine's forward passes during the steps: each decode pass follows a token sampled for at least one row
    # in the same round, and each sampling round (a decode pass, or a batch's last, which runs no pass and ends
    # before the next prefill) serves at most the 8 workers' rows; each step's window can split one round at its start
    decode = sum(r["engine_decode_steps"] for r in rows)
    prefills = sum(r["engine_prefills"] for r in rows)
    generated = sum(r["tokens_per_s"] * r["wall_s"] for r in rows)
    assert decode > 0 and prefills > 0
    assert decode <= generated + len(rows) + 1e-6
    assert generated <= 8 * (decode + prefills + len(rows)) + 1e-6
    # the engine thread's own CPU while it was busy: some, and never more than the busy wall time (one thread)
    assert all(0.0 <= r["engine_cpu_s"] <= r["engine_busy_s"] + 1e-3 for r in rows)
    assert sum(r["engine_cpu_s"] for r in rows) > 0
    assert (out / "reward_curve.png").stat().st_size > 1000
    assert any((out / "tensorboard").iterdir())
    assert "held-out success" in stdout
    # the learner's and the engine's threads were chosen from the run's own steps 2-4 (one per candidate split;
    # step 1 skipped): on 2 cores 1+2, 2+2 and 1+1
    balance = summary["balance"]
    assert [t["split"] for t in balance["trials"]] == balance["candidates"]
    assert balance["chosen"] in balance["candidates"]
    assert balance["rates"][balance["chosen"]] == max(balance["rates"].values())
    learner_threads, engine_threads = (int(n) for n in balance["chosen"].split("+"))
    assert (balance["learner_threads"], balance["engine_threads"]) == (learner_threads, engine_threads)
    assert balance["moved"] is None  # the choice came at step 4, the last: no steps after it were watched
    assert f"learner threads: {learner_threads}, engine threads: {engine_threads} (" in stdout
    # the RL workers started with the evaluation before RL ([rl] generate_during_eval, on by default): train
    # rollouts ran while the baseline was measured, and every call of that evaluation (and of those rollouts) was
    # served by the starting weights, version 0: nothing was published before the baseline was taken
    tl = summary["timeline"]
    assert tl["rl_workers_start_s"] <= tl["eval_before_end_s"] <= tl["rl_start_s"]
    eval_end, train_first = _split_times(out / "store.db", "eval-before")
    assert train_first < eval_end
    versions = _versions_before(out / "store.db", eval_end)
    assert versions["eval-before"] == {0} and versions["train"] == {0}


def test_the_rl_workers_go_on_generating_during_a_target_check(tmp_path: Path, small_policy: Path) -> None:
    """``[rl] generate_during_eval`` (on by default) also keeps the RL workers generating through the target checks:
    train rollouts succeed while the check's held-out attempts run (the learner is paused meanwhile), and RL ends
    at the check that reached the target (a gain of -1: the first one)."""
    config = _write_config(
        tmp_path / "train.toml",
        str(small_policy),
        warm_start={"enabled": False},
        rl={
            "steps": 40,
            "tasks_per_step": 4,
            "samples_per_task": 4,
            "workers": 8,
            "max_tokens": 16,
            "target_gain": -1.0,  # any gain: the first check (after 5 steps, 64 fresh rollouts) reaches it
            "max_wall_s": 1000,
        },
        eval={"n": 48, "max_tokens": 16, "workers": 2},
    )
    out = tmp_path / "run"
    stdout, _ = _train(config, out).communicate(timeout=240)
    summary = json.loads((out / "summary.json").read_text())
    checks = summary["rl"]["checks"]
    assert [c["reached"] for c in checks] == [True], stdout.decode()[-3000:]
    db = out / "store.db"
    with sqlite3.connect(db) as conn:
        start, end = conn.execute(
            "SELECT MIN(a.started_at), MAX(a.ended_at) FROM attempts a JOIN rollouts r USING (rollout_id) "
            "WHERE r.split = 'eval-check-1'"
        ).fetchone()
        during = conn.execute(
            "SELECT COUNT(*) FROM attempts a JOIN rollouts r USING (rollout_id) WHERE r.split = 'train' "
            "AND a.status = 'succeeded' AND a.ended_at > ? AND a.ended_at < ?",
            (start, end),
        ).fetchone()[0]
    # train rollouts went on succeeding while the check ran (stopped workers would have released them before it)
    assert during >= 1
    assert summary["eval_after"]["split"] == "eval-check-1"  # the checked weights are the run's result
    assert summary["rl"]["stop"]["reason"] == "target" and summary["stopped_short"] is None


def _split_times(db: Path, split: str) -> tuple[float, float]:
    """When the last attempt of ``split`` ended, and when the first train attempt started (store clock)."""
    with sqlite3.connect(db) as conn:
        (end,) = conn.execute(
            "SELECT MAX(a.ended_at) FROM attempts a JOIN rollouts r USING (rollout_id) WHERE r.split = ?", (split,)
        ).fetchone()
        (first,) = conn.execute(
            "SELECT MIN(a.started_at) FROM attempts a JOIN rollouts r USING (rollout_id) WHERE r.split = 'train'"
        ).fetchone()
    return float(end), float(first)


def _versions_before(db: Path, t: float) -> dict[str, set[int]]:
    """The policy versions of the calls that started before ``t``, per split."""
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            "SELECT r.split, json_extract(c.body, '$.policy_version') FROM calls c JOIN rollouts r USING (rollout_id) "
            "WHERE c.started_at < ?",
            (t,),
        ).fetchall()
    out: dict[str, set[int]] = {}
    for split, version in rows:
        out.setdefault(split, set()).add(int(version))
    return out


PARITY_AGENT = """
import openai

import lightning_sdk as ls


@ls.rollout(timeout=120)
async def agent(task, llm):
    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    response = await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["question"]}], max_tokens=16
    )
    return float(len(response.choices[0].message.content or "") % 2)
"""


def _consumed_in_store(db: Path) -> dict[str, int]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            "SELECT group_id, consumed_step FROM groups WHERE split = 'train' AND consumed_step IS NOT NULL"
        ).fetchall()
    return {gid: int(step) for gid, step in rows}


@pytest.mark.parametrize("screen", [0, 2], ids=["whole-groups", "screened-groups"])
def test_sigkill_mid_training_resumes_with_no_group_trained_twice_or_lost(
    tmp_path: Path, small_policy: Path, screen: int
) -> None:
    """With ``screen_samples`` the groups of fresh tasks start at two of four rollouts and are screened out or grown
    (app/loop.py): the checkpoint and the store still agree on every group, rests and screened-out ones included."""
    steps, per_step = 8, 4
    config = _write_config(
        tmp_path / "train.toml",
        str(small_policy),
        warm_start={"enabled": False},
        rl={
            "steps": steps,
            "tasks_per_step": per_step,
            "samples_per_task": 4 if screen else 2,
            "screen_samples": screen,
            "workers": 8,
            "max_tokens": 16,
            "drop_zero_variance": bool(screen),  # screening needs it (the parity agent gives the variance)
            "max_staleness": 1,
            "max_wall_s": 1000,
        },
        eval={"enabled": False},
    )
    if screen:  # the untrained policy never solves a calc task: an agent whose reward varies with the sample
        (tmp_path / "parity_agent.py").write_text(PARITY_AGENT)
        text = config.read_text().splitlines()
        config.write_text("\n".join([f'agent = "{tmp_path / "parity_agent.py"}:agent"', *text[1:]]) + "\n")
    out = tmp_path / "run"
    proc = _train(config, out)

    def third_step_or_exit() -> bool:
        ckpt = load_checkpoint(out) if (out / "checkpoint.pt").exists() else None
        return proc.poll() is not None or (ckpt is not None and ckpt.step >= 3)

    until(third_step_or_exit, timeout=180, what="the third checkpoint", every=0.05)
    killed_at = None
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed_at = load_checkpoint(out)
    assert killed_at is not None and 3 <= killed_at.step < steps, "the run ended before it could be killed"
    before_restart = _consumed_in_store(out / "store.db")

    proc = _train(config, out)
    stdout, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, stdout.decode()[-3000:]

    final = load_checkpoint(out)
    assert final is not None and final.step == steps
    # held-out evaluation is off: the summary still holds eval objects, with nulls and n = 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_before"] == summary["eval_after"] == {"success_rate": None, "mean_reward": None, "n": 0}
    # Steps checkpointed before the kill kept their groups: nothing was retrained after the restart.
    for step in range(1, killed_at.step + 1):
        assert final.consumed[step] == killed_at.consumed[step]
    # Each step trained its own groups (a grown group: its first rollouts' group and its rest); no group in two
    # steps.
    trained = [gid for s in range(1, steps + 1) for gid in final.consumed[s]["trained"]]
    assert all(
        len([g for g in final.consumed[s]["trained"] if not g.endswith("-rest")]) == per_step
        for s in range(1, steps + 1)
    )
    every = trained + [gid for s in final.consumed.values() for gid in s["dropped"] + s.get("screened", [])]
    assert len(every) == len(set(every))
    if screen:  # groups grew and were screened out; every rest was trained with its own first rollouts
        rests = [g for g in trained if g.endswith("-rest")]
        assert rests and any(s.get("screened") for s in final.consumed.values())
        for s in range(1, steps + 1):
            mine = final.consumed[s]["trained"]
            assert all(g.removesuffix("-rest") in mine for g in mine if g.endswith("-rest"))
    # The store agrees with the checkpoint exactly: every group it marks consumed was trained (or dropped as
    # stale, or screened out) by that very step, and every checkpointed group is marked: none lost, none twice.
    store = _consumed_in_store(out / "store.db")
    assert store == {gid: s for s in final.consumed for gid in final.groups_of(s)}
    assert all(store[gid] == step for gid, step in before_restart.items())
    assert final.version == steps  # one weight publication per step
    weights = torch.load(out / "checkpoint.pt", weights_only=False)["learner"]["steps"]
    assert weights == steps


async def test_daemon_serves_external_workers(tmp_path: Path, small_policy: Path) -> None:
    """``lightning-sdk daemon`` prints its URL and admin key; workers elsewhere (here: this process, over HTTP)
    claim its tasks through the store API and the daemon trains on what they finish."""
    import asyncio

    from lightning_sdk.agent import WorkerPool, load_agent
    from lightning_sdk.store import open_store

    steps = 2
    config = _write_config(
        tmp_path / "daemon.toml",
        str(small_policy),
        warm_start={"enabled": False},
        rl={"steps": steps, "tasks_per_step": 2, "samples_per_task": 2, "max_tokens": 16, "drop_zero_variance": False},
        eval={"enabled": False},
    )
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LIGHTNING_SDK_LOG_LEVEL": "WARNING"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CLI,
        "daemon",
        "--config",
        str(config),
        "--output",
        str(out),
        cwd=str(ROOT),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert proc.stdout is not None
    url = key = None
    lines: list[str] = []
    while url is None or key is None:
        line = (await asyncio.wait_for(proc.stdout.readline(), timeout=120)).decode()
        assert line, "".join(lines)
        lines.append(line)
        if line.startswith("trainer daemon ready: "):
            url = line.split(": ", 1)[1].strip()
        elif line.startswith("admin key: "):
            key = line.split(": ", 1)[1].strip()
    store = open_store(url + "/lightning/v1/store", admin_key=key)
    # the run viewer on the daemon, behind the admin key: a bearer header, or ?key= once (a cookie, then redirected)
    import httpx

    ui = url + "/lightning/v1/ui"
    async with httpx.AsyncClient(timeout=30, follow_redirects=True) as http:
        assert (await http.get(ui + "/api/overview")).status_code == 401
        overview = await http.get(ui + "/api/overview", headers={"Authorization": f"Bearer {key}"})
        assert overview.status_code == 200 and overview.json()["run_dir"] == str(out)
        login = await http.get(ui + "/rollouts", params={"key": key, "status": "queued"})
        assert login.status_code == 200 and login.url.path == "/lightning/v1/ui/rollouts"
        assert "key" not in login.url.params and login.url.params["status"] == "queued"
        assert 'href="/lightning/v1/ui/static/viewer.css"' in login.text  # links stay under the mount
    agent = load_agent(f"{EXAMPLE / 'agent.py'}:agent")
    pool = WorkerPool(agent, store, url, n_workers=4, split="train", poll_s=0.05)
    worker = asyncio.create_task(pool.run_until(lambda: proc.returncode is not None))
    rest = await asyncio.wait_for(proc.stdout.read(), timeout=180)
    await proc.wait()
    pool.stop(release=True)
    await worker
    await pool.close()
    await store.close()
    assert proc.returncode == 0, "".join(lines) + rest.decode()
    ckpt = load_checkpoint(out)
    assert ckpt is not None and ckpt.step == steps and ckpt.version == steps
    assert all(len(ckpt.consumed[s]["trained"]) == 2 for s in range(1, steps + 1))
    assert (out / "model" / "config.json").exists()
    assert pool.stats.count("succeeded") >= steps * 2 * 2


def test_a_lora_warm_start_is_evaluated_on_the_adapted_weights(tmp_path: Path, small_policy: Path) -> None:
    """``[learner] lora`` with a warm start: the warm start trains the adapter, and each of its evaluations serves
    the learner's published (merged) weights. Before, the evaluation handed the engine the PEFT model's own
    state_dict, whose attention tensors carry PEFT's names: the engine skipped them without a word and the
    evaluations measured the base model; the engine now refuses such a state (tests/trainer/test_lora.py), so this
    run would fail there."""
    config = _write_config(
        tmp_path / "train.toml",
        str(small_policy),
        warm_start={
            "max_steps": 2,
            "eval_every": 1,
            "eval_below_loss": 100.0,
            "target_success": 1.0,
            "batch_size": 4,
            "validation_tasks": 4,
        },
        rl={"steps": 1, "tasks_per_step": 2, "samples_per_task": 2, "workers": 4, "max_tokens": 16},
        learner={"lora.rank": 4, "lora.alpha": 8.0},  # TOML dotted keys: [learner] lora = {...}
        eval={"n": 4, "max_tokens": 16, "workers": 4},
    )
    summary, _ = _train_to_end(config, tmp_path / "run")
    assert summary["warm_start"]["steps"] == 2
    assert [step for step, _ in summary["warm_start"]["history"]] == [1, 2]
    assert summary["steps"] == 1
