"""``lightning-sdk train``: the whole main job in one process, top to bottom.

    open_job (run dir, socket, policy, store + proxy + engine + learner: app/job.py)
      ─▶ warm start (supervised, stopped on measured success through the proxy) ─▶ held-out eval (before)
      ─▶ RL: in-process agent workers + the training loop (app/loop.py ``run_rl``), paused for held-out checks
         when a target gain is set ─▶ held-out eval (after) ─▶ model + summary.json

Evaluations run the user's agent code through the proxy on held-out tasks with the sampling settings of
``[eval]`` (greedy by default: the proxy's rule for evaluation splits), written into ``summary.json``. A run
directory that already holds a checkpoint is resumed (warm start and the first evaluation are not repeated).

Stopping (``stop()`` turning true: the CLI's SIGINT/SIGTERM handler) is graceful and ordered: the warm start stops
at its next supervised step or evaluation, an evaluation releases its in-flight attempts, the RL workers release
theirs, the learner finishes the step it is in (and checkpoints it), and only then the proxy stops; the call raises
``RunStopped``. Re-running with the same run directory resumes from the last checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_sdk.agent import CommandAgent, load_agent
from lightning_sdk.app.job import open_job
from lightning_sdk.app.loop import StepReport, never
from lightning_sdk.app.rl import RLWorkers, evaluate, run_rl
from lightning_sdk.app.view import ProgressView, plot_reward_curve
from lightning_sdk.app.warmup import run_warm_start
from lightning_sdk.memory import malloc_settings
from lightning_sdk.trainer.balance import BalancedThreads
from lightning_sdk.trainer.config import TrainConfig
from lightning_sdk.trainer.stopping import GainTarget, WallBudget

__all__ = ["NO_EVAL", "run_training"]

#: ``eval_before`` / ``eval_after`` in ``summary.json`` when held-out evaluation is off (or never ran).
NO_EVAL: dict[str, Any] = {"success_rate": None, "mean_reward": None, "n": 0}


async def run_training(
    config: TrainConfig,
    run_dir: str | Path,
    *,
    view: ProgressView | None = None,
    stop: Callable[[], bool] = never,
) -> dict[str, Any]:
    """Run the main job (see the module docstring); returns the summary written to ``RUN_DIR/summary.json``.
    Raises ``RunStopped`` when ``stop()`` turned true first (no summary then; the checkpoint resumes)."""
    agent = load_agent(config.agent)
    rl, ev = config.rl, config.eval
    async with open_job(config, run_dir, view=view, heldout=True, max_attempts=agent.max_attempts) as job:
        loop, parts, metrics, view, out = job.loop, job.parts, job.metrics, job.view, job.out
        note, t_start, timeline, heldout = view.note, job.t_start, job.timeline, job.tasks.heldout
        state_path = out / "state.json"
        state: dict[str, Any] = json.loads(state_path.read_text()) if state_path.exists() else {}
        warm = await run_warm_start(job, agent, stop)
        if warm is not None:
            state["warm_start"] = warm
        job.mark("warm_start_end_s")

        async def held_out(split: str, label: str) -> dict[str, Any]:
            view.set_phase(f"evaluating {len(heldout)} held-out tasks ({label})")
            return await evaluate(loop, agent, heldout, split, ev.workers, stop)

        # The RL workers start with the evaluation before RL when it runs: the first groups are generated on the
        # weights being evaluated (nothing is trained before it ends), so the learner's first steps find them ready
        # instead of waiting for the whole first batch (rl.RLWorkers; run_rl takes them over and, with the same
        # setting, keeps them generating during the target checks).
        early: RLWorkers | None = None
        if heldout and "eval_before" not in state and rl.generate_during_eval and rl.steps > loop.step:
            early = await RLWorkers.start(loop, agent, rl.workers)
            job.mark("rl_workers_start_s")
        try:
            if heldout and "eval_before" not in state:
                state["eval_before"] = await held_out("eval-before", "before")
                note(f"held-out success before RL: {100 * state['eval_before']['success_rate']:.1f}%")
            job.mark("eval_before_end_s")
            state_path.write_text(json.dumps(state))

            view.set_phase("RL")
            job.mark("rl_start_s")
            target = (
                GainTarget(
                    state["eval_before"]["success_rate"],
                    rl.target_gain,
                    margin=rl.target_margin,
                    min_steps=rl.check_min_steps,
                    recheck_min_steps=rl.recheck_min_steps,
                    max_steps=rl.check_max_steps,
                )
                if rl.target_gain is not None and heldout and "eval_before" in state
                else None
            )

            # RL ends early enough for the final evaluation (the evaluation before RL measures it), so with a target
            # that evaluation is a last check that runs before max_wall_s, whatever the trigger said
            budget = (
                WallBudget(t_start + rl.max_wall_s, check_s=float(state.get("eval_before", {}).get("wall_s", 0.0)))
                if rl.max_wall_s
                else None
            )

            # the split of the cores between learner and engine, chosen from the first steps' measures
            # (trainer/balance.py; the engine's threads where it is the embedded engine)
            balance = BalancedThreads.for_job(
                loop.learner, loop.engine, engine_threads_set=config.engine.threads is not None
            )

            def on_step(report: StepReport) -> None:
                if balance is not None:
                    tokens = float(report.metrics.get("tokens", 0.0))
                    chose = balance.after_step(
                        report.learner_s,
                        tokens,
                        report.tokens_per_s,
                        report.generated_tokens,
                        wait_s=report.wait_s,
                        wall_s=report.wall_s,
                    )
                    if chose is not None:
                        note(chose)
                if target is not None:
                    target.observe_step(report.fresh_outcomes)
                row = report.as_dict()
                row["elapsed_s"] = round(time.perf_counter() - t_start, 2)
                if target is not None:
                    row["fresh_success_rolling"] = target.rolling
                metrics.write(row)
                view.step(report)

            done = await run_rl(
                loop,
                agent,
                steps=rl.steps,
                workers=rl.workers,
                on_step=on_step,
                held_out=held_out,
                target=target,
                budget=budget,
                t_start=t_start,
                note=note,
                on_rl=lambda: view.set_phase("RL"),
                stop=stop,
                running=early,
                generate_during_checks=rl.generate_during_eval,
            )
        finally:
            if early is not None:  # run_rl closed them, unless something failed before it could
                await early.close()

        if done.final is not None:  # the last check is the final evaluation: nothing was trained after it
            state["eval_after"] = done.final
        if done.reached is not None:
            timeline["target_reached_s"] = done.checks[-1]["elapsed_s"]
        state["rl"] = {
            "steps": loop.step,
            "wall_s": round(done.wall_s, 2),
            "learner_busy_s": round(loop.learner_busy_s, 2),
            "checks": done.checks,
            "stop": done.stop,
        }
        if balance is not None:
            state["balance"] = balance.balance.as_dict()
        job.mark("rl_end_s")

        if heldout and "eval_after" not in state:
            state["eval_after"] = await held_out("eval-after", "after")
            note(f"held-out success after RL: {100 * state['eval_after']['success_rate']:.1f}%")
        job.mark("eval_after_end_s")
        model_out = out / "model"
        await asyncio.to_thread(parts.save_model, model_out)

    before = state.get("eval_before", {}).get("success_rate")
    after = state.get("eval_after", {}).get("success_rate")
    all_rows = _read_metrics(out / "metrics.jsonl")
    curve = plot_reward_curve(all_rows, out / "reward_curve.png", before=before, after=after)
    rules = job.sampling
    summary: dict[str, Any] = {
        "eval_before": state.get("eval_before") or dict(NO_EVAL),
        "eval_after": state.get("eval_after") or dict(NO_EVAL),
        "steps": loop.step,
        "wall_s": round(time.perf_counter() - t_start, 2),
        "model_dir": str(model_out.resolve()),
        "eval_sampling": rules.override_for("eval-after"),
        "train_sampling": rules.override_for("train"),
        "warm_start": state.get("warm_start"),
        "rl": state.get("rl"),
        "dropped_stale_groups": loop.dropped_total,
        "reward_curve": str(curve) if curve else None,
        "balance": state.get("balance"),
        "malloc": malloc_settings(),  # glibc's thresholds as lightning_sdk/memory.py set them (None: not set)
        "stopped_short": (state.get("rl") or {}).get("stop", {}).get("message") if _short(state) else None,
        "resumed": job.resumed,
        "timeline": timeline,
        # what the agent's sandboxes were held to (None without)
        "sandbox": agent.sandbox.summary() if isinstance(agent, CommandAgent) and agent.sandbox is not None else None,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    view.set_phase("done")
    return summary


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _short(state: dict[str, Any]) -> bool:
    """Whether RL ended with a target it did not meet (``rl.stop.short``)."""
    return bool((state.get("rl") or {}).get("stop", {}).get("short"))
