"""``lightning-sdk daemon --config FILE``: the trainer daemon, serving workers on other processes or machines.

Store + proxy + embedded engine + learner, waiting for workers (``lightning-sdk run MODULE:AGENT --server URL``).
Prints the URL and the admin key once the proxy is up, enqueues the config's train tasks and trains ``rl.steps``
steps on the groups the workers finish. SIGINT/SIGTERM stop after the current step; re-running with the same
``--output`` resumes from the last checkpoint.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import typer
from rich.console import Console

from lightning_sdk.cli._app import app
from lightning_sdk.errors import LightningSDKError

__all__ = ["daemon_command"]


@app.command("daemon")
def daemon_command(
    config: Path = typer.Option(..., "--config", "-c", help="Training config (TOML/YAML/JSON) or a directory."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Run directory (default: runs/NAME-daemon-TIME)."),
    host: str | None = typer.Option(None, help="Bind address (default 127.0.0.1)."),
    port: int | None = typer.Option(None, help="Port (default: the config's, else a free one)."),
    admin_key: str | None = typer.Option(
        None, "--admin-key", envvar="LIGHTNING_SDK_ADMIN_KEY", help="Admin key (generated when not given)."
    ),
) -> None:
    """Run the trainer daemon: a proxy and a trainer that wait for agent workers."""
    from lightning_sdk.trainer.config import load_train_config
    from lightning_sdk.trainer.run import run_daemon
    from lightning_sdk.trainer.view import ProgressView

    console = Console(stderr=True)
    overrides: dict[str, object] = {}
    if host:
        overrides["host"] = host
    if port is not None:
        overrides["port"] = port
    stopping = False

    def ready(url: str, key: str) -> None:
        console.print(f"trainer daemon ready: {url}", markup=False)
        console.print(f"admin key: {key}", markup=False)
        console.print(f"workers: lightning-sdk run MODULE:AGENT --server {url} --workers N", markup=False)

    async def main() -> dict[str, object]:
        def request_stop() -> None:
            nonlocal stopping
            stopping = True

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, request_stop)
        with ProgressView(cfg.name, cfg.rl.steps, console=console) as view:
            return await run_daemon(cfg, run_dir, admin_key=admin_key, view=view, on_ready=ready, stop=lambda: stopping)

    try:
        cfg = load_train_config(config, overrides)
        run_dir = output or Path("runs") / f"{cfg.name}-daemon-{time.strftime('%Y%m%d-%H%M%S')}"
        result = asyncio.run(main())
    except LightningSDKError as exc:
        console.print(f"error: {exc}", markup=False)
        raise typer.Exit(1) from None
    console.print(f"{result['steps']} steps; model: {result['model_dir']}", markup=False)
