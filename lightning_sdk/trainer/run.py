"""``lightning-sdk train``: the whole main job in one process.

    policy (build the tiny default, or load a model dir) ─▶ daemon (store + proxy + engine + learner) up
      ─▶ warm start (supervised, stopped on measured success through the proxy) ─▶ held-out eval (before)
      ─▶ RL: in-process agent workers + the async training loop ─▶ held-out eval (after) ─▶ model + summary

Evaluations run the user's agent code through the proxy on held-out tasks with the sampling settings of
``[eval]`` (greedy by default), written into ``summary.json``. A run directory that already holds a checkpoint is
resumed (warm start and the first evaluation are not repeated).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_sdk.agent import WorkerPool, load_agent, run_tasks
from lightning_sdk.agent._base import Agent
from lightning_sdk.engines.embedded import EmbeddedEngine
from lightning_sdk.errors import ConfigError
from lightning_sdk.policy.model import TinyPolicyConfig, build_policy, load_policy
from lightning_sdk.policy.tokenizer import build_tokenizer
from lightning_sdk.policy.warm_start import WarmStartConfig, warm_start
from lightning_sdk.records import AdvantageConfig, RecordsConfig
from lightning_sdk.store import open_store
from lightning_sdk.trainer.checkpoint import load_checkpoint
from lightning_sdk.trainer.config import TrainConfig
from lightning_sdk.trainer.daemon import StepReport, TrainerDaemon
from lightning_sdk.trainer.data import load_rows
from lightning_sdk.trainer.learner import Learner, LearnerConfig
from lightning_sdk.trainer.view import MetricsLog, ProgressView, plot_reward_curve

__all__ = ["build_daemon", "prepare_policy", "run_daemon", "run_training"]

logger = logging.getLogger(__name__)


def prepare_policy(config: TrainConfig, run_dir: Path, demonstrations: list[dict[str, Any]]) -> Path:
    """The initial policy directory: the configured model dir, or the tiny default built in ``run_dir``."""
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
    config: TrainConfig, run_dir: Path, model_dir: Path, train_tasks: list[dict[str, Any]]
) -> TrainerDaemon:
    """Store (SQLite in the run dir) + engine + learner + daemon for ``model_dir``."""
    rl = config.rl
    model, tokenizer = load_policy(model_dir)
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer, max_batch_size=256)
    learner = Learner(
        model,
        LearnerConfig(
            lr=rl.lr,
            warmup_steps=rl.warmup_steps,
            grad_clip=rl.grad_clip,
            clip_ratio_low=rl.clip_ratio,
            clip_ratio_high=rl.clip_ratio,
            tis_cap=rl.tis_cap,
            kl_coef=rl.kl_coef,
            temperature=rl.temperature,
            micro_batch_tokens=rl.micro_batch_tokens,
        ),
    )
    store = open_store(run_dir / "store.db")
    records = RecordsConfig(advantage=AdvantageConfig(estimator=rl.estimator, drop_zero_variance=rl.drop_zero_variance))
    return TrainerDaemon(
        store,
        engine,
        learner,
        run_dir,
        train_tasks=train_tasks,
        tasks_per_step=rl.tasks_per_step,
        samples_per_task=rl.samples_per_task,
        max_staleness=rl.max_staleness,
        records_config=records,
        rollout_sampling={"temperature": rl.temperature, "top_p": 1.0, "max_tokens": rl.max_tokens},
        admin_key=secrets.token_urlsafe(24),
        host=config.host,
        port=config.port,
    )


async def _evaluate(
    daemon: TrainerDaemon, agent: Agent, tasks: list[dict[str, Any]], split: str, sampling: dict[str, Any], workers: int
) -> dict[str, Any]:
    """Run the agent on ``tasks`` through the proxy with ``sampling`` forced; the ``eval_*`` entry of the summary."""
    previous = daemon.engine.sampling_override
    daemon.engine.sampling_override = dict(sampling)
    try:
        t0 = time.perf_counter()
        summary = await run_tasks(agent, daemon.store, daemon.url, tasks, n_workers=workers, split=split, poll_s=0.05)
    finally:
        daemon.engine.sampling_override = previous
    out = summary.to_dict()
    out.pop("failed", None)
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    return out


async def _warm_start(
    daemon: TrainerDaemon,
    agent: Agent,
    config: TrainConfig,
    demos: list[dict[str, Any]],
    val: list[dict[str, Any]],
    note: Callable[[str], None],
) -> dict[str, Any]:
    """Supervised steps on the learner's model; every ``eval_every`` steps the engine gets the weights and the agent
    is evaluated on ``val`` through the proxy (sampling as in ``[eval]``)."""
    loop = asyncio.get_running_loop()
    ws, ev = config.warm_start, config.eval
    sampling = {"temperature": ev.temperature, "max_tokens": ev.max_tokens}
    rounds = 0

    def evaluate(model: torch.nn.Module) -> float:
        nonlocal rounds
        rounds += 1
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}

        async def go() -> float:
            await daemon.engine.update_weights(state, daemon.version)
            res = await _evaluate(daemon, agent, val, f"warmup-{rounds}", sampling, ev.workers)
            return float(res["success_rate"])

        success = asyncio.run_coroutine_threadsafe(go(), loop).result()
        note(f"warm start eval {rounds}: {100 * success:.1f}% on {len(val)} validation tasks")
        return success

    cfg = WarmStartConfig(
        lr=ws.lr,
        batch_size=ws.batch_size,
        max_steps=ws.max_steps,
        eval_every=ws.eval_every,
        eval_below_loss=ws.eval_below_loss,
        target_success=ws.target_success,
    )
    model = daemon.learner.model
    result = await asyncio.to_thread(warm_start, model, daemon.engine.tokenizer, demos, evaluate, cfg)
    daemon.learner.reset_optimizer()
    await daemon.engine.update_weights(daemon.learner.weights(), daemon.version)
    return {"steps": result.steps, "success": result.success, "history": result.history, "wall_s": result.wall_s}


async def run_training(config: TrainConfig, run_dir: str | Path, *, view: ProgressView | None = None) -> dict[str, Any]:
    """Run the main job (see the module docstring); returns the summary written to ``RUN_DIR/summary.json``."""
    t_start = time.perf_counter()
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
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

    view.set_phase("building the policy")
    model_dir = prepare_policy(config, out, demos)
    daemon = build_daemon(config, out, model_dir, train_tasks)
    await daemon.start()
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
            state["warm_start"] = await _warm_start(daemon, agent, config, demos, val, note)
            note(f"warm start: {state['warm_start']['steps']} steps, {state['warm_start']['wall_s']:.0f} s")
        if heldout and "eval_before" not in state:
            view.set_phase(f"evaluating {len(heldout)} held-out tasks (before)")
            state["eval_before"] = await _evaluate(
                daemon, agent, heldout, "eval-before", eval_sampling, config.eval.workers
            )
            note(f"held-out success before RL: {100 * state['eval_before']['success_rate']:.1f}%")
        state_path.write_text(json.dumps(state))

        view.set_phase("RL")
        rows: list[dict[str, Any]] = []

        def on_step(report: StepReport) -> None:
            row = report.as_dict()
            row["elapsed_s"] = round(time.perf_counter() - t_start, 2)
            rows.append(row)
            metrics.write(row)
            view.step(report)

        pool = WorkerPool(agent, daemon.store, daemon.url, n_workers=config.rl.workers, split="train", poll_s=0.05)
        stopping = False
        pool_task = asyncio.create_task(pool.run_until(lambda: stopping))
        deadline = t_start + config.rl.max_wall_s if config.rl.max_wall_s else None
        t_rl = time.perf_counter()
        try:
            await daemon.train_steps(config.rl.steps, deadline=deadline, on_step=on_step)
        finally:
            stopping = True
            pool.stop(release=True)
            await pool_task
            await pool.close()
        await daemon.flush_weights()
        rl_wall = time.perf_counter() - t_rl
        busy = daemon.learner_busy_s
        state["rl"] = {"steps": daemon.step, "wall_s": round(rl_wall, 2), "learner_busy_s": round(busy, 2)}

        if heldout:
            view.set_phase(f"evaluating {len(heldout)} held-out tasks (after)")
            state["eval_after"] = await _evaluate(
                daemon, agent, heldout, "eval-after", eval_sampling, config.eval.workers
            )
            note(f"held-out success after RL: {100 * state['eval_after']['success_rate']:.1f}%")
        model_out = out / "model"
        daemon.learner.model.save_pretrained(str(model_out))
        daemon.engine.tokenizer.save_pretrained(str(model_out))
    finally:
        metrics.close()
        await daemon.stop()
        await daemon.engine.close()
        await daemon.store.close()

    before = state.get("eval_before", {}).get("success_rate")
    after = state.get("eval_after", {}).get("success_rate")
    all_rows = _read_metrics(out / "metrics.jsonl")
    curve = plot_reward_curve(all_rows, out / "reward_curve.png", before=before, after=after)
    summary: dict[str, Any] = {
        "eval_before": state.get("eval_before"),
        "eval_after": state.get("eval_after"),
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
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    view.set_phase("done")
    return summary


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
    stop: Callable[[], bool] = lambda: False,
) -> dict[str, Any]:
    """``lightning-sdk daemon``: serve the proxy and train on what external workers produce.

    Builds (and warm-starts, validating with the configured agent in process) the policy like ``run_training``,
    enqueues ``data.train`` tasks for the workers, then trains ``rl.steps`` steps; ``on_ready(url, admin_key)`` is
    called once the proxy is up.
    """
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.rl.seed)
    data = config.data
    train_tasks = load_rows(config, data.train, "data.train") if data.train else []
    demos = load_rows(config, data.demonstrations, "data.demonstrations") if data.demonstrations else []
    view = view or ProgressView(config.name, config.rl.steps)
    resumed = load_checkpoint(out) is not None
    model_dir = prepare_policy(config, out, demos)
    daemon = build_daemon(config, out, model_dir, train_tasks)
    if admin_key:
        daemon.admin_key = admin_key
    await daemon.start()
    (out / "daemon.json").write_text(json.dumps({"url": daemon.url, "admin_key": daemon.admin_key}))
    metrics = MetricsLog(out, backends=config.metrics, name=config.name)
    try:
        if not resumed and config.warm_start.enabled and demos:
            agent = load_agent(config.resolve(config.agent))
            val = load_rows(config, data.validation, "data.validation") if data.validation else train_tasks[-64:]
            view.set_phase("warm start")
            await _warm_start(daemon, agent, config, demos, val, view.note)
        if on_ready is not None:
            on_ready(daemon.url, daemon.admin_key)
        view.set_phase("waiting for workers")

        def on_step(report: StepReport) -> None:
            metrics.write(report.as_dict())
            view.step(report)

        await daemon.train_steps(config.rl.steps, on_step=on_step, stop=stop)
        model_out = out / "model"
        daemon.learner.model.save_pretrained(str(model_out))
        daemon.engine.tokenizer.save_pretrained(str(model_out))
    finally:
        metrics.close()
        await daemon.stop()
        await daemon.engine.close()
        await daemon.store.close()
    return {"steps": daemon.step, "model_dir": str((out / "model").resolve()), "url": daemon.url}
