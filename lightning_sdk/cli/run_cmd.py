"""``lightning-sdk run MODULE:AGENT --server URL --workers N [--tasks FILE.jsonl --admin-key KEY]``: agent workers.

``--fallback-server URL`` (repeatable) names more proxies on the same store (docs/scale-out.md): the agents' LLM
calls fail over to them, in turn, when the one in use cannot be reached or dies mid-call (``LLM.fallback_urls``);
the workers' store, reward and finish requests stay on ``--server``.

Without ``--tasks`` the workers pull attempts from the server's queue (a trainer daemon) until SIGINT/SIGTERM.
With ``--tasks`` they first enqueue exactly those tasks (one JSON object per line) in a split of their own, run
exactly them, print a summary (success rate, mean reward, n, failures with their traceback or stderr tail) and
exit: the way to collect traces through a plain ``lightning-sdk proxy`` or to evaluate an agent over a dataset.

The store is reached over HTTP at ``URL/lightning/v1/store`` with the admin key; the agent's LLM calls go to
``URL/v1`` with each attempt's token. Shutdown: the first SIGINT (or SIGTERM) stops claiming and lets in-flight
attempts finish; a second SIGINT, or ``--grace`` seconds after SIGTERM, releases them back to the queue.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from lightning_sdk.agent import Agent, load_agent
from lightning_sdk.agent.tasks import RunSummary, run_tasks
from lightning_sdk.agent.worker import AttemptResult, WorkerPool, policy_model_name
from lightning_sdk.cli._app import app
from lightning_sdk.errors import ConfigError, LightningSDKError
from lightning_sdk.types import Task

__all__ = ["read_tasks", "run_command"]

logger = logging.getLogger(__name__)


def read_tasks(path: Path) -> list[Task]:
    """The tasks of a JSONL file (one JSON object per line; blank lines skipped)."""
    if not path.exists():
        raise ConfigError(f"tasks file {path} does not exist")
    tasks: list[Task] = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{i}: not JSON ({exc.msg})") from exc
        if not isinstance(obj, dict):
            raise ConfigError(f"{path}:{i}: a task must be a JSON object, got {type(obj).__name__}")
        tasks.append(obj)
    if not tasks:
        raise ConfigError(f"{path} holds no tasks")
    return tasks


class _Progress:
    """A rich progress bar fed by the pool's results (rollouts done out of the total, with live counters)."""

    def __init__(self, console: Console, total: int | None, tries: int, enabled: bool) -> None:
        self.tries = tries
        self.failed_tries: dict[str, int] = {}
        self.counts = {"succeeded": 0, "failed": 0, "retried": 0}
        self.bar = Progress(
            TextColumn("[bold]rollouts"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=console,
            disable=not enabled,
            transient=False,
        )
        self.task_id = self.bar.add_task("rollouts", total=total, info="")

    def __call__(self, r: AttemptResult) -> None:
        done = 0
        if r.status == "succeeded":
            self.counts["succeeded"] += 1
            done = 1
        elif r.status in ("failed", "timed_out", "lost"):
            n = self.failed_tries[r.rollout_id] = self.failed_tries.get(r.rollout_id, 0) + 1
            if n >= self.tries:
                self.counts["failed"] += 1
                done = 1
            else:
                self.counts["retried"] += 1
        info = " ".join(f"{k} {v}" for k, v in self.counts.items())
        self.bar.update(self.task_id, advance=done, info=info)


def _print_summary(console: Console, summary: RunSummary | None, results: list[AttemptResult]) -> None:
    failures = [r for r in results if r.status in ("failed", "timed_out", "lost")]
    if summary is not None:
        console.print(
            f"[bold]n={summary.n}[/]  succeeded={summary.succeeded}  "
            f"success_rate={summary.success_rate:.3f}  mean_reward={summary.mean_reward:.4f}  split={summary.split}"
        )
    else:
        by: dict[str, int] = {}
        for r in results:
            by[r.status] = by.get(r.status, 0) + 1
        console.print(f"[bold]attempts={len(results)}[/]  " + "  ".join(f"{k}={v}" for k, v in sorted(by.items())))
    for r in failures[:5]:
        console.rule(f"[red]{r.status}[/] rollout {r.rollout_id} attempt {r.attempt_id}")
        console.print((r.error or "")[-2000:], markup=False, highlight=False)
    if len(failures) > 5:
        console.print(f"... and {len(failures) - 5} more failed attempts")


async def _run(
    agent: Agent,
    server: str,
    admin_key: str,
    *,
    workers: int,
    tasks: list[Task] | None,
    n: int,
    model: str | None,
    max_attempts: int | None,
    timeout: float | None,
    split: str | None,
    lease_s: float,
    grace_s: float,
    console: Console,
    show_progress: bool,
    fallbacks: tuple[str, ...] = (),
) -> tuple[RunSummary | None, list[AttemptResult], bool]:
    from lightning_sdk.store.http_client import HTTPStore

    store = HTTPStore(f"{server}/lightning/v1/store", admin_key)
    try:
        model_name = model or await policy_model_name(store)
        tries = max_attempts if max_attempts is not None else agent.max_attempts
        total = len(tasks) * n if tasks is not None else None
        progress = _Progress(console, total, tries, show_progress)
        run_split = split
        if tasks is not None and run_split is None:
            import uuid

            run_split = f"run-{uuid.uuid4().hex[:8]}"
        pool = WorkerPool(
            agent,
            store,
            server,
            n_workers=workers,
            model=model_name,
            lease_s=lease_s,
            default_timeout=timeout,
            split=run_split,
            on_result=progress,
            fallback_urls=fallbacks,
        )
        interrupted = _install_signals(pool, console, grace_s)
        try:
            with progress.bar:
                if tasks is not None:
                    summary: RunSummary | None = await run_tasks(
                        agent, store, server, tasks, n=n, split=run_split, max_attempts=tries, pool=pool
                    )
                else:
                    summary = None
                    await pool.run_until()
        finally:
            await pool.close()
        return summary, pool.results, bool(interrupted)
    finally:
        await store.close()


def _install_signals(pool: WorkerPool, console: Console, grace_s: float) -> list[int]:
    """First SIGINT/SIGTERM: drain. Second SIGINT, or ``grace_s`` after SIGTERM: release in-flight attempts."""
    loop = asyncio.get_running_loop()
    received: list[int] = []

    def on_signal(sig: int) -> None:
        received.append(sig)
        if len(received) == 1:
            console.print("[yellow]stopping: no new attempts; in-flight attempts finish (again to release them)[/]")
            pool.stop()
            if sig == signal.SIGTERM:
                loop.call_later(grace_s, lambda: pool.stop(release=True))
        else:
            console.print("[yellow]releasing in-flight attempts back to the queue[/]")
            pool.stop(release=True)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    return received


def _root(server: str) -> str:
    root = server.rstrip("/")
    if root.endswith("/v1"):  # people paste the OpenAI base URL; the server's root is what we need
        root = root[: -len("/v1")]
    if not root.startswith(("http://", "https://")):
        raise ConfigError(f"{server!r} is not an http(s) URL")
    return root


@app.command("run")
def run_command(
    agent: str = typer.Argument(..., help="MODULE:AGENT, FILE.py:AGENT, or a YAML/JSON command agent config."),
    server: str = typer.Option(..., "--server", envvar="LIGHTNING_SDK_SERVER", help="Proxy/daemon root URL."),
    workers: int = typer.Option(4, "--workers", "-w", min=1, help="Attempts run at once."),
    tasks: Path | None = typer.Option(None, "--tasks", help="JSONL tasks: enqueue exactly these, run them, exit."),
    admin_key: str | None = typer.Option(None, "--admin-key", envvar="LIGHTNING_SDK_ADMIN_KEY", help="Server key."),
    n: int = typer.Option(1, "--n", min=1, help="Rollouts per task (with --tasks)."),
    model: str | None = typer.Option(None, "--model", help="Model name for the agent (default: the policy's)."),
    max_attempts: int | None = typer.Option(None, "--max-attempts", min=1, help="Tries per rollout (--tasks)."),
    timeout: float | None = typer.Option(None, "--timeout", help="Seconds per attempt when the agent sets none."),
    split: str | None = typer.Option(None, "--split", help="Split for --tasks (default: a fresh run-<id>)."),
    lease: float = typer.Option(60.0, "--lease", help="Attempt lease in seconds (renewed by heartbeats)."),
    grace: float = typer.Option(30.0, "--grace", help="Seconds in-flight attempts get after SIGTERM."),
    summary_path: Path | None = typer.Option(None, "--summary", help="Write the summary as JSON to this file."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar."),
    fallback_servers: list[str] = typer.Option(
        [],
        "--fallback-server",
        help="Root URL of another proxy on the same store (repeatable): the agents' LLM calls fail over to it.",
    ),
) -> None:
    """Run agent workers against a daemon, or run exactly the tasks of a JSONL file through a proxy."""
    console = Console(stderr=True)
    try:
        if not admin_key:
            raise ConfigError("--admin-key (or LIGHTNING_SDK_ADMIN_KEY) is needed to reach the server's store")
        if summary_path is not None and (summary_path.is_dir() or not summary_path.parent.is_dir()):
            raise ConfigError(f"--summary {summary_path}: not a writable file path (is its folder there?)")
        root = _root(server)
        fallbacks = tuple(_root(u) for u in fallback_servers)
        the_agent = load_agent(agent)
        task_list = read_tasks(tasks) if tasks is not None else None
        summary, results, interrupted = asyncio.run(
            _run(
                the_agent,
                root,
                admin_key,
                workers=workers,
                tasks=task_list,
                n=n,
                model=model,
                max_attempts=max_attempts,
                timeout=timeout,
                split=split,
                lease_s=lease,
                grace_s=grace,
                console=console,
                show_progress=progress,
                fallbacks=fallbacks,
            )
        )
    except LightningSDKError as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from exc
    _print_summary(console, summary, results)
    if summary_path is not None:
        payload: dict[str, Any] = summary.to_dict() if summary is not None else {}
        payload["attempts"] = [
            {"rollout_id": r.rollout_id, "attempt_id": r.attempt_id, "status": r.status, "reward": r.reward}
            for r in results
        ]
        summary_path.write_text(json.dumps(payload, indent=2), encoding="utf-8")
    if interrupted and summary is not None and summary.n < len(task_list or []) * n:
        raise typer.Exit(130)
