"""``lightning-sdk daemon``: serve the proxy and train on what workers on other processes or machines produce.

    open_job (the same set-up as ``train``: app/job.py; the admin key may be given, ``on_ready`` hears the URL and
    key as soon as the proxy listens) ─▶ warm start (the agent in process validates, as in ``train``)
      ─▶ train ``rl.steps`` steps on the groups external workers finish (``lightning-sdk run ... --server URL``)
      ─▶ model

With ``[cluster] ray`` (``--ray ADDRESS``) the engines and the learner are Ray actors (``app/parts.py``) and
``cluster.workers`` worker actors run the agent against this daemon (``lightning_sdk/cluster``); ``cluster.json`` in
the run directory says where each part runs (rewritten after every step), and ``summary.json`` ends the run with the
steps, the wall time and what happened to the actors.

Raises ``RunStopped`` when ``stop()`` turned true before the last step (the checkpoint resumes). ``kill -USR1`` a
running daemon to have it print every thread's stack and every asyncio task's to stderr (where a stuck run waits).
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import io
import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_sdk.agent import load_agent
from lightning_sdk.app.job import Job, open_job
from lightning_sdk.app.loop import RunStopped, StepReport, never
from lightning_sdk.app.view import ProgressView
from lightning_sdk.app.warmup import run_warm_start
from lightning_sdk.trainer.config import TrainConfig

if TYPE_CHECKING:
    from lightning_sdk.cluster import ClusterRun

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
    t0 = time.perf_counter()
    cluster = config.cluster
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not on Windows / not the main thread
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump_stacks)
    tries = cluster.max_attempts if cluster.ray else 1
    async with open_job(
        config, run_dir, view=view, admin_key=admin_key, on_ready=on_ready, require_train=False, max_attempts=tries
    ) as job:
        if job.needs_warm_start and not stop():
            await run_warm_start(job, load_agent(config.agent), stop)
        job.view.set_phase("waiting for workers")
        placed = await _place_workers(job) if cluster.ray else None
        steps: list[asyncio.Task[None]] = []

        def on_step(report: StepReport) -> None:
            job.metrics.write(report.as_dict())
            job.view.step(report)
            if placed is not None:  # where the parts run now (a restarted actor may have moved)
                steps.append(asyncio.ensure_future(placed.write(job.out)))

        workers: list[Any] = []
        try:
            await job.loop.train_steps(config.rl.steps, on_step=on_step, stop=stop)
        finally:
            if placed is not None:
                await asyncio.gather(*steps, return_exceptions=True)
                with contextlib.suppress(Exception):  # where the parts ended (a restarted actor may have moved)
                    await asyncio.wait_for(placed.write(job.out), 60)
                workers = await placed.run.stop()
        if job.loop.step < config.rl.steps:
            raise RunStopped(job.loop.step)
        await asyncio.to_thread(job.parts.save_model, job.out / "model")
        if placed is not None:
            await job.parts.engine.check()  # every engine back and serving the last version (restarts: its events)
            summary = {
                "steps": job.loop.step,
                "wall_s": round(time.perf_counter() - t0, 2),
                "model_dir": str((job.out / "model").resolve()),
                "cluster": {
                    "ray": cluster.ray,
                    "placements": placed.last,
                    "engine_events": list(job.parts.engine.events),
                    "engine_resent_calls": job.parts.engine.stats.get("resent", 0),
                    "learner_events": list(job.parts.learner.events),
                    "learner_steps": job.parts.learner.steps,
                    "engines": await job.parts.engine.where(),
                    "workers": workers,
                },
            }
            (job.out / "summary.json").write_text(json.dumps(summary, indent=2))
    return {"steps": job.loop.step, "model_dir": str((job.out / "model").resolve()), "url": job.server.url}


def dump_stacks() -> None:
    """Every thread's stack and every asyncio task's, to stderr (``kill -USR1`` a daemon: where does it wait?)."""
    faulthandler.dump_traceback(all_threads=True)
    out = io.StringIO()
    tasks = asyncio.all_tasks()
    out.write(f"--- {len(tasks)} asyncio tasks ---\n")
    for task in tasks:
        out.write(f"{task!r}\n")
        task.print_stack(limit=12, file=out)
    sys.stderr.write(out.getvalue())
    sys.stderr.flush()


class _Placed:
    """The worker actors of a daemon on a cluster and the last placements written to ``cluster.json``."""

    def __init__(self, job: Job, run: ClusterRun) -> None:
        self.job = job
        self.run = run
        self.last: list[dict[str, Any]] = []

    async def write(self, out: Path) -> None:
        engines = await self.job.parts.engine.where()
        # a RayLearner's (sync: its actor answers between steps); None for a learner in this process
        learner = await asyncio.to_thread(self.job.parts.learner.where)
        learners = [learner] if learner is not None else []
        self.last = [*engines, *learners, *await self.run.placements()]
        tmp = out / "cluster.json.tmp"
        tmp.write_text(json.dumps({"step": self.job.loop.step, "parts": self.last}, indent=2))
        tmp.replace(out / "cluster.json")


async def _place_workers(job: Job) -> _Placed:
    """Start ``cluster.workers`` worker actors running the agent against this daemon; write ``cluster.json``."""
    from lightning_sdk.cluster import ClusterRun

    config = job.config
    run = await ClusterRun.start(
        config.cluster,
        config.agent,
        job.server.url,
        job.admin_key,
        engine=job.parts.engine,
        model_dir=job.model_dir,
        sampling=job.sampling,
        host=config.host,
        shared_store=url if (url := config.store.url) and url.startswith(("postgresql://", "postgres://")) else None,
    )
    placed = _Placed(job, run)
    await placed.write(job.out)
    job.view.note(
        f"{config.cluster.proxies} proxy and {config.cluster.workers} worker actors on the Ray cluster "
        f"({job.out / 'cluster.json'})"
    )
    return placed
