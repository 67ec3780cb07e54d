"""``lightning-sdk daemon``: serve the proxy and train on what workers on other processes or machines produce.

    open_job (the same set-up as ``train``: app/job.py; the admin key may be given, ``on_ready`` hears the URL and
    key as soon as the proxy listens) ─▶ warm start (the agent in process validates, as in ``train``)
      ─▶ train ``rl.steps`` steps on the groups external workers finish (``lightning-sdk run ... --server URL``)
      ─▶ model

Raises ``RunStopped`` when ``stop()`` turned true before the last step (the checkpoint resumes).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_sdk.agent import load_agent
from lightning_sdk.app.job import open_job
from lightning_sdk.app.loop import RunStopped, StepReport, never
from lightning_sdk.app.view import ProgressView
from lightning_sdk.app.warmup import run_warm_start
from lightning_sdk.trainer.config import TrainConfig

__all__ = ["run_daemon"]


async def run_daemon(
    config: TrainConfig,
    run_dir: str | Path,
    *,
    admin_key: str | None = None,
    view: ProgressView | None = None,
    on_ready: Callable[[str, str], None] | None = None,
    stop: Callable[[], bool] = never,
) -> dict[str, Any]:
    """Serve, warm-start if configured, enqueue ``data.train`` for the workers and train ``rl.steps`` steps."""
    async with open_job(config, run_dir, view=view, admin_key=admin_key, on_ready=on_ready, require_train=False) as job:
        if job.needs_warm_start and not stop():
            await run_warm_start(job, load_agent(config.agent), stop)
        job.view.set_phase("waiting for workers")

        def on_step(report: StepReport) -> None:
            job.metrics.write(report.as_dict())
            job.view.step(report)

        await job.loop.train_steps(config.rl.steps, on_step=on_step, stop=stop)
        if job.loop.step < config.rl.steps:
            raise RunStopped(job.loop.step)
        await asyncio.to_thread(job.parts.save_model, job.out / "model")
    return {"steps": job.loop.step, "model_dir": str((job.out / "model").resolve()), "url": job.server.url}
