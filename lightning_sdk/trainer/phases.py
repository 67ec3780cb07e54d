"""The phases of a run around RL: held-out evaluation and the warm start, both through the daemon's proxy.

Used by the jobs in ``lightning_sdk/app/`` so each reads as its sequence of phases. Both honour ``stop()`` (the CLI's
SIGINT/SIGTERM): an evaluation releases its in-flight attempts, the warm start ends at its next supervised step;
either raises ``RunStopped``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel

from lightning_sdk.agent import WorkerPool, run_tasks
from lightning_sdk.agent._base import Agent
from lightning_sdk.errors import TrainerError
from lightning_sdk.policy.warm_start import WarmStartConfig, warm_start
from lightning_sdk.trainer.config import TrainConfig
from lightning_sdk.trainer.daemon import TrainerDaemon

__all__ = ["RunStopped", "evaluate", "never", "warm_start_phase"]


class RunStopped(TrainerError):
    """The run was asked to stop (``stop()`` turned true) before it finished; ``step`` is the last checkpointed one."""

    def __init__(self, step: int) -> None:
        super().__init__(f"stopped at step {step}")
        self.step = step


def never() -> bool:
    """The default ``stop``: never."""
    return False


async def evaluate(
    daemon: TrainerDaemon,
    agent: Agent,
    tasks: list[dict[str, Any]],
    split: str,
    workers: int,
    stop: Callable[[], bool] = never,
) -> dict[str, Any]:
    """Run the agent on ``tasks`` through the proxy as ``split`` (the proxy samples it by the split's rule: see
    ``app.job.split_sampling``); the ``eval_*`` entry of the summary. When ``stop()`` turns true the in-flight
    attempts are released and ``RunStopped`` is raised."""
    pool = WorkerPool(agent, daemon.store, daemon.url, n_workers=workers, split=split, poll_s=0.05)

    async def watch() -> None:
        while not stop():
            await asyncio.sleep(0.05)
        pool.stop(release=True)

    watcher = asyncio.create_task(watch())
    try:
        t0 = time.perf_counter()
        summary = await run_tasks(agent, daemon.store, daemon.url, tasks, split=split, pool=pool, poll_s=0.05)
    finally:
        watcher.cancel()
        await pool.close()
    if stop():
        raise RunStopped(daemon.step)
    out = summary.to_dict()
    out.pop("failed", None)
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    return out


async def warm_start_phase(
    daemon: TrainerDaemon,
    agent: Agent,
    config: TrainConfig,
    demos: list[dict[str, Any]],
    val: list[dict[str, Any]],
    note: Callable[[str], None],
    model: PreTrainedModel,
    stop: Callable[[], bool] = never,
) -> dict[str, Any]:
    """Supervised steps on the learner's model; every ``eval_every`` steps the engine gets the weights and the agent
    is evaluated on ``val`` through the proxy (sampling as in ``[eval]``). ``model`` is the learner's torch model.
    ``stop()`` turning true ends it at the next supervised step or evaluation with ``RunStopped`` (nothing is
    checkpointed: a re-run warm-starts again)."""
    loop = asyncio.get_running_loop()
    ws, ev = config.warm_start, config.eval
    rounds = 0

    def evaluate_model(model: torch.nn.Module) -> float:
        nonlocal rounds
        rounds += 1
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}

        async def go() -> float:
            await daemon.engine.update_weights(state, daemon.version)
            res = await evaluate(daemon, agent, val, f"warmup-{rounds}", ev.workers, stop)
            return float(res["success_rate"])

        success = asyncio.run_coroutine_threadsafe(go(), loop).result()
        note(f"warm start eval {rounds}: {100 * success:.1f}% on {len(val)} validation tasks")
        return success

    cfg = WarmStartConfig.model_validate(ws.model_dump(include=set(WarmStartConfig.model_fields)))
    result = await asyncio.to_thread(warm_start, model, daemon.engine.tokenizer, demos, evaluate_model, cfg, stop)
    if result.stopped:
        raise RunStopped(daemon.step)
    reset = getattr(daemon.learner, "reset_optimizer", None)
    if reset is not None:  # the supervised steps moved the weights the optimizer's moments were for
        reset()
    await daemon.engine.update_weights(await asyncio.to_thread(daemon.weights), daemon.version)
    return {"steps": result.steps, "success": result.success, "history": result.history, "wall_s": result.wall_s}
