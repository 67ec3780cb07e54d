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
                steps.append(asyncio.ensure_future(placed.write()))

        workers: list[Any] = []
        try:
            await job.loop.train_steps(config.rl.steps, on_step=on_step, stop=stop)
        finally:
            if placed is not None:
                await asyncio.gather(*steps, return_exceptions=True)
                # where the parts ended (a restarted actor may have moved); a part that cannot answer now (an engine
                # whose restart is under way) stays as last seen: the engines and the learner are asked again below
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(placed.write(), 60)
                workers = await placed.run.stop()
        if job.loop.step < config.rl.steps:
            raise RunStopped(job.loop.step)
        await asyncio.to_thread(job.parts.save_model, job.out / "model")
        if placed is not None:
            await job.parts.engine.check()  # every engine back and serving the last version (restarts: its events)
            placements_error = await placed.refresh()
            summary = {
                "steps": job.loop.step,
                "wall_s": round(time.perf_counter() - t0, 2),
                "model_dir": str((job.out / "model").resolve()),
                "cluster": {
                    "ray": cluster.ray,
                    "placements": placed.last,
                    "placements_error": placements_error,
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
        self.out = job.out
        self.last: list[dict[str, Any]] = []

    async def _learner(self) -> list[dict[str, Any]]:
        # a RayLearner's (sync: its actor answers between steps); None for a learner in this process
        learner = await asyncio.to_thread(self.job.parts.learner.where)
        return [learner] if learner is not None else []

    async def _ask(self, *sources: Any) -> BaseException | None:
        """Each source's parts asked at once; a source that fails (an engine down while Ray restarts it) keeps its
        parts as last seen. ``cluster.json`` is rewritten either way; the first failure is answered."""
        found = await asyncio.gather(*(source() for source in sources), return_exceptions=True)
        fresh = [p for parts in found if not isinstance(parts, BaseException) for p in parts]
        names = {p["part"] for p in fresh}
        self.last = sorted([*fresh, *(p for p in self.last if p["part"] not in names)], key=_part_order)
        self._save(self.out)
        return next((e for e in found if isinstance(e, BaseException)), None)

    async def write(self) -> None:
        """Where every part runs now (``cluster.json``); raises what a source raised, after saving the rest."""
        failed = await self._ask(self.job.parts.engine.where, self._learner, self.run.placements)
        if failed is not None:
            raise failed

    async def refresh(self) -> str | None:
        """At the end, with every engine back: the engines' and the learner's places asked again (the proxies and
        workers, stopped by then, as last seen); why not, when that fails (the summary records it rather than keep
        stale places without a word)."""
        try:
            failed = await asyncio.wait_for(self._ask(self.job.parts.engine.where, self._learner), 60)
        except TimeoutError as exc:
            failed = exc
        if failed is None:
            return None
        why = f"{type(failed).__name__}: {failed}"
        self.job.view.note(f"where the engines and the learner ended is not known (kept as last seen): {why}")
        return why

    def _save(self, out: Path) -> None:
        tmp = out / "cluster.json.tmp"
        tmp.write_text(json.dumps({"step": self.job.loop.step, "parts": self.last}, indent=2))
        tmp.replace(out / "cluster.json")


def _part_order(part: dict[str, Any]) -> tuple[int, int, str]:
    """``cluster.json``'s order: engines, the learner, proxies, workers (each by its number)."""
    name = str(part["part"])
    kind, _, index = name.partition("-")
    kinds = ("engine", "learner", "proxy", "worker")
    return (kinds.index(kind) if kind in kinds else len(kinds), int(index) if index.isdigit() else 0, name)


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
    await placed.write()
    job.view.note(
        f"{config.cluster.proxies} proxy and {config.cluster.workers} worker actors on the Ray cluster "
        f"({job.out / 'cluster.json'})"
    )
    return placed
