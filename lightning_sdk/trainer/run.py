"""``lightning-sdk train``: the whole main job in one process.

    policy (build the tiny default, or load a model dir) ─▶ daemon (store + proxy + engine + learner) up
      ─▶ warm start (supervised, stopped on measured success through the proxy) ─▶ held-out eval (before)
      ─▶ RL: in-process agent workers + the async training loop ─▶ held-out eval (after) ─▶ model + summary

The engine and learner come from ``factory.build_parts`` (``backend``: embedded or verl; ``[engine]``: embedded,
SGLang or vLLM); evaluation and the warm start live in ``phases.py``.

Evaluations run the user's agent code through the proxy on held-out tasks with the sampling settings of
``[eval]`` (greedy by default), written into ``summary.json``. A run directory that already holds a checkpoint is
resumed (warm start and the first evaluation are not repeated).

Stopping (``stop()`` turning true: the CLI's SIGINT/SIGTERM handler) is graceful and ordered: the warm start stops
at its next supervised step or evaluation, an evaluation releases its in-flight attempts, the RL workers release
theirs, the learner finishes the step it is in (and checkpoints it), and only then the proxy stops; the call raises
``RunStopped``. Re-running with the same run directory resumes from the last checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_sdk.agent import WorkerPool, load_agent
from lightning_sdk.errors import ConfigError
from lightning_sdk.policy.model import TinyPolicyConfig, build_policy
from lightning_sdk.policy.smollm2 import SMOLLM2_NAMES, prepare_smollm2
from lightning_sdk.policy.tokenizer import build_tokenizer
from lightning_sdk.records import AdvantageConfig, RecordsConfig
from lightning_sdk.store import open_store
from lightning_sdk.trainer.checkpoint import load_checkpoint
from lightning_sdk.trainer.config import TrainConfig
from lightning_sdk.trainer.daemon import StepReport, TrainerDaemon, bind_socket
from lightning_sdk.trainer.data import load_rows
from lightning_sdk.trainer.factory import Parts, build_parts, check_warm_start
from lightning_sdk.trainer.phases import RunStopped, evaluate, never, warm_start_phase
from lightning_sdk.trainer.sampling import TaskSampler
from lightning_sdk.trainer.stopping import GainTarget
from lightning_sdk.trainer.view import MetricsLog, ProgressView, plot_reward_curve

__all__ = ["RunStopped", "build_daemon", "prepare_policy", "prepare_run_dir", "run_daemon", "run_training"]

logger = logging.getLogger(__name__)

#: ``eval_before`` / ``eval_after`` in ``summary.json`` when held-out evaluation is off (or never ran).
NO_EVAL: dict[str, Any] = {"success_rate": None, "mean_reward": None, "n": 0}


def prepare_run_dir(path: str | Path) -> Path:
    """Create the run directory and check it is writable, up front: a clear ``ConfigError``, not a traceback after
    minutes of set-up, when ``--output`` is an existing file or an unwritable place."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output {out}: exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"--output {out}: cannot write there ({exc.strerror or exc})") from None
    return out


def prepare_policy(config: TrainConfig, run_dir: Path, demonstrations: list[dict[str, Any]]) -> Path:
    """The initial policy directory: the configured model dir, or the tiny default built in ``run_dir``."""
    if config.policy.model in SMOLLM2_NAMES:
        return prepare_smollm2()
    if config.policy.model != "tiny":
        path = Path(config.resolve(config.policy.model))
        if not (path / "config.json").exists():
            raise ConfigError(f"policy.model {path} is not a Hugging Face model directory")
        return path
    out = run_dir / "policy_init"
    if (out / "config.json").exists():
        return out
    if not demonstrations:
        raise ConfigError("the tiny default policy needs data.demonstrations to train its tokenizer and warm start")
    bootstrap = build_tokenizer(["x"], vocab_size=300)  # any tokenizer with the chat template renders the corpus
    corpus = [
        str(bootstrap.apply_chat_template(d["messages"], tools=d.get("tools"), tokenize=False)) for d in demonstrations
    ]
    p = config.policy
    shape = TinyPolicyConfig(p.vocab_size, p.hidden_size, p.num_layers, p.num_heads, p.intermediate_size, seed=p.seed)
    return build_policy(out, corpus, shape)


def build_daemon(
    config: TrainConfig,
    run_dir: Path,
    model_dir: Path,
    train_tasks: list[dict[str, Any]],
    sock: socket.socket | None = None,
    max_attempts: int = 1,
) -> tuple[TrainerDaemon, Parts]:
    """Store (SQLite in the run dir) + the engine and learner of ``config.backend`` / ``config.engine``
    (``factory.build_parts``) + daemon for ``model_dir``, serving on ``sock`` if given (bound up front by
    ``bind_socket``), else on ``config.host:config.port``. Close the parts after the daemon stopped."""
    rl = config.rl
    parts = build_parts(config, run_dir, model_dir)
    store = open_store(run_dir / "store.db")
    records = RecordsConfig(advantage=AdvantageConfig(estimator=rl.estimator, drop_zero_variance=rl.drop_zero_variance))
    sampler = (
        TaskSampler(len(train_tasks), replay_share=rl.replay_share, max_replays=rl.max_replays, seed=rl.seed)
        if rl.replay_share > 0 and train_tasks
        else None
    )
    daemon = TrainerDaemon(
        store,
        parts.engine,
        parts.learner,
        run_dir,
        weights=parts.weights,
        train_tasks=train_tasks,
        tasks_per_step=rl.tasks_per_step,
        samples_per_task=rl.samples_per_task,
        max_staleness=rl.max_staleness,
        records_config=records,
        max_attempts=max_attempts,
        rollout_sampling={"temperature": rl.temperature, "top_p": 1.0, "max_tokens": rl.max_tokens},
        admin_key=secrets.token_urlsafe(24),
        host=config.host,
        port=config.port,
        sock=sock,
        sampler=sampler,
    )
    if sampler is not None:
        sampler.start_at(daemon.next_task)
    return daemon, parts


async def run_training(
    config: TrainConfig,
    run_dir: str | Path,
    *,
    view: ProgressView | None = None,
    stop: Callable[[], bool] = never,
) -> dict[str, Any]:
    """Run the main job (see the module docstring); returns the summary written to ``RUN_DIR/summary.json``.
    Raises ``RunStopped`` when ``stop()`` turned true first (no summary then; the checkpoint resumes)."""
    t_start = time.perf_counter()
    out = prepare_run_dir(run_dir)
    sock = bind_socket(config.host, config.port)
    try:
        return await _run_training(config, out, sock, t_start, view, stop)
    finally:
        sock.close()


async def _run_training(
    config: TrainConfig,
    out: Path,
    sock: socket.socket,
    t_start: float,
    view: ProgressView | None,
    stop: Callable[[], bool],
) -> dict[str, Any]:
    (out / "config.json").write_text(config.model_dump_json(indent=2))
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.rl.seed)
    data = config.data
    train_tasks = load_rows(config, data.train, "data.train")
    heldout = load_rows(config, data.heldout, "data.heldout")[: config.eval.n] if config.eval.enabled else []
    demos = load_rows(config, data.demonstrations, "data.demonstrations") if data.demonstrations else []
    agent = load_agent(config.resolve(config.agent))
    view = view or ProgressView(config.name, config.rl.steps)
    note = view.note
    resumed = load_checkpoint(out) is not None
    timeline: dict[str, float] = {}  # seconds since the start of the command when each phase ended

    check_warm_start(config, not resumed and config.warm_start.enabled and bool(demos))
    view.set_phase("building the policy")
    model_dir = prepare_policy(config, out, demos)
    daemon, parts = build_daemon(config, out, model_dir, train_tasks, sock, max_attempts=agent.max_attempts)
    await daemon.start()
    timeline["startup_s"] = round(time.perf_counter() - t_start, 2)
    note(f"proxy on {daemon.url} (admin key in {out / 'daemon.json'})")
    (out / "daemon.json").write_text(json.dumps({"url": daemon.url, "admin_key": daemon.admin_key}))
    metrics = MetricsLog(out, backends=config.metrics, name=config.name)
    eval_sampling = {"temperature": config.eval.temperature, "max_tokens": config.eval.max_tokens}
    state_path = out / "state.json"
    state: dict[str, Any] = json.loads(state_path.read_text()) if state_path.exists() else {}
    try:
        if not resumed and config.warm_start.enabled and demos:
            view.set_phase("warm start")
            val = (
                load_rows(config, data.validation, "data.validation")
                if data.validation
                else train_tasks[-config.warm_start.validation_tasks :]
            )
            assert parts.model is not None  # check_warm_start: only the embedded backend warm-starts
            state["warm_start"] = await warm_start_phase(daemon, agent, config, demos, val, note, parts.model, stop)
            note(f"warm start: {state['warm_start']['steps']} steps, {state['warm_start']['wall_s']:.0f} s")
        timeline["warm_start_end_s"] = round(time.perf_counter() - t_start, 2)
        if heldout and "eval_before" not in state:
            view.set_phase(f"evaluating {len(heldout)} held-out tasks (before)")
            state["eval_before"] = await evaluate(
                daemon, agent, heldout, "eval-before", eval_sampling, config.eval.workers, stop
            )
            note(f"held-out success before RL: {100 * state['eval_before']['success_rate']:.1f}%")
        timeline["eval_before_end_s"] = round(time.perf_counter() - t_start, 2)
        state_path.write_text(json.dumps(state))

        view.set_phase("RL")
        timeline["rl_start_s"] = round(time.perf_counter() - t_start, 2)
        target = (
            GainTarget(state["eval_before"]["success_rate"], config.rl.target_gain, margin=config.rl.target_margin)
            if config.rl.target_gain is not None and heldout and "eval_before" in state
            else None
        )

        def on_step(report: StepReport) -> None:
            if target is not None:
                target.observe_step(report.fresh_outcomes)
            row = report.as_dict()
            row["elapsed_s"] = round(time.perf_counter() - t_start, 2)
            if target is not None:
                row["fresh_success_rolling"] = target.rolling
            metrics.write(row)
            view.step(report)

        deadline = t_start + config.rl.max_wall_s if config.rl.max_wall_s else None
        t_rl = time.perf_counter()
        checks: list[dict[str, Any]] = []
        pause = target.due if target is not None else never

        def stop_or_pause() -> bool:
            return stop() or pause()

        while True:
            await _rl_round(daemon, agent, config, on_step, deadline, stop_or_pause)
            if stop():
                raise RunStopped(daemon.step)
            if target is None or not target.due():
                break
            await daemon.flush_weights()  # the check evaluates the newest weights
            t_check = time.perf_counter()
            view.set_phase(f"evaluating {len(heldout)} held-out tasks (target check at step {daemon.step})")
            result = await evaluate(
                daemon, agent, heldout, f"eval-check-{target.checks + 1}", eval_sampling, config.eval.workers, stop
            )
            reached = target.reached(result["success_rate"])
            checks.append(
                {
                    "step": daemon.step,
                    "success_rate": result["success_rate"],
                    "reached": reached,
                    "elapsed_s": round(time.perf_counter() - t_start, 2),
                    "wall_s": round(time.perf_counter() - t_check, 2),
                }
            )
            note(
                f"held-out check at step {daemon.step}: {100 * result['success_rate']:.1f}%"
                f" ({'target reached' if reached else 'going on'})"
            )
            if reached:
                state["eval_after"] = result
                timeline["target_reached_s"] = checks[-1]["elapsed_s"]
                break
            if daemon.step >= config.rl.steps or (deadline is not None and time.perf_counter() >= deadline):
                break
            view.set_phase("RL")
        await daemon.flush_weights()
        rl_wall = time.perf_counter() - t_rl
        busy = daemon.learner_busy_s
        state["rl"] = {
            "steps": daemon.step,
            "wall_s": round(rl_wall, 2),
            "learner_busy_s": round(busy, 2),
            "checks": checks,
        }
        timeline["rl_end_s"] = round(time.perf_counter() - t_start, 2)

        if heldout and "eval_after" not in state:
            view.set_phase(f"evaluating {len(heldout)} held-out tasks (after)")
            state["eval_after"] = await evaluate(
                daemon, agent, heldout, "eval-after", eval_sampling, config.eval.workers, stop
            )
            note(f"held-out success after RL: {100 * state['eval_after']['success_rate']:.1f}%")
        timeline["eval_after_end_s"] = round(time.perf_counter() - t_start, 2)
        model_out = out / "model"
        await asyncio.to_thread(parts.save_model, model_out)
    finally:  # the workers are done (or released their attempts) by now: the proxy stops last
        metrics.close()
        await daemon.stop()
        await parts.close()
        await daemon.store.close()

    before = state.get("eval_before", {}).get("success_rate")
    after = state.get("eval_after", {}).get("success_rate")
    all_rows = _read_metrics(out / "metrics.jsonl")
    curve = plot_reward_curve(all_rows, out / "reward_curve.png", before=before, after=after)
    summary: dict[str, Any] = {
        "eval_before": state.get("eval_before") or dict(NO_EVAL),
        "eval_after": state.get("eval_after") or dict(NO_EVAL),
        "steps": daemon.step,
        "wall_s": round(time.perf_counter() - t_start, 2),
        "model_dir": str(model_out.resolve()),
        "eval_sampling": eval_sampling,
        "train_sampling": daemon.rollout_sampling,
        "warm_start": state.get("warm_start"),
        "rl": state.get("rl"),
        "dropped_stale_groups": daemon.dropped_total,
        "reward_curve": str(curve) if curve else None,
        "resumed": resumed,
        "timeline": timeline,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    view.set_phase("done")
    return summary


async def _rl_round(
    daemon: TrainerDaemon,
    agent: Any,
    config: TrainConfig,
    on_step: Callable[[StepReport], None],
    deadline: float | None,
    stop: Callable[[], bool],
) -> None:
    """Run the in-process workers and train until ``rl.steps``, ``deadline`` or ``stop()``; the workers release
    their in-flight attempts when it ends."""
    pool = WorkerPool(agent, daemon.store, daemon.url, n_workers=config.rl.workers, split="train", poll_s=0.05)
    stopping = False
    pool_task = asyncio.create_task(pool.run_until(lambda: stopping))
    try:
        await daemon.train_steps(config.rl.steps, deadline=deadline, on_step=on_step, stop=stop)
    finally:
        stopping = True
        pool.stop(release=True)
        await pool_task
        await pool.close()


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def run_daemon(
    config: TrainConfig,
    run_dir: str | Path,
    *,
    admin_key: str | None = None,
    view: ProgressView | None = None,
    on_ready: Callable[[str, str], None] | None = None,
    stop: Callable[[], bool] = never,
) -> dict[str, Any]:
    """``lightning-sdk daemon``: serve the proxy and train on what external workers produce.

    Builds (and warm-starts, validating with the configured agent in process) the policy like ``run_training``,
    enqueues ``data.train`` tasks for the workers, then trains ``rl.steps`` steps; ``on_ready(url, admin_key)`` is
    called as soon as the proxy listens (before the warm start). The port is bound first, so a bad or busy one
    fails before the policy is built. Raises ``RunStopped`` when ``stop()`` turned true before the last step.
    """
    out = prepare_run_dir(run_dir)
    sock = bind_socket(config.host, config.port)
    try:
        return await _run_daemon(config, out, sock, admin_key, view, on_ready, stop)
    finally:
        sock.close()


async def _run_daemon(
    config: TrainConfig,
    out: Path,
    sock: socket.socket,
    admin_key: str | None,
    view: ProgressView | None,
    on_ready: Callable[[str, str], None] | None,
    stop: Callable[[], bool],
) -> dict[str, Any]:
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.rl.seed)
    data = config.data
    train_tasks = load_rows(config, data.train, "data.train") if data.train else []
    demos = load_rows(config, data.demonstrations, "data.demonstrations") if data.demonstrations else []
    view = view or ProgressView(config.name, config.rl.steps)
    resumed = load_checkpoint(out) is not None
    check_warm_start(config, not resumed and config.warm_start.enabled and bool(demos))
    model_dir = prepare_policy(config, out, demos)
    daemon, parts = build_daemon(config, out, model_dir, train_tasks, sock)
    if admin_key:
        daemon.admin_key = admin_key
    await daemon.start()
    (out / "daemon.json").write_text(json.dumps({"url": daemon.url, "admin_key": daemon.admin_key}))
    if on_ready is not None:
        on_ready(daemon.url, daemon.admin_key)
    metrics = MetricsLog(out, backends=config.metrics, name=config.name)
    try:
        if not resumed and config.warm_start.enabled and demos and not stop():
            agent = load_agent(config.resolve(config.agent))
            val = load_rows(config, data.validation, "data.validation") if data.validation else train_tasks[-64:]
            view.set_phase("warm start")
            assert parts.model is not None  # check_warm_start: only the embedded backend warm-starts
            await warm_start_phase(daemon, agent, config, demos, val, view.note, parts.model, stop)
        view.set_phase("waiting for workers")

        def on_step(report: StepReport) -> None:
            metrics.write(report.as_dict())
            view.step(report)

        await daemon.train_steps(config.rl.steps, on_step=on_step, stop=stop)
        if daemon.step < config.rl.steps:
            raise RunStopped(daemon.step)
        model_out = out / "model"
        await asyncio.to_thread(parts.save_model, model_out)
    finally:
        metrics.close()
        await daemon.stop()
        await parts.close()
        await daemon.store.close()
    return {"steps": daemon.step, "model_dir": str((out / "model").resolve()), "url": daemon.url}
