"""``lightning-sdk daemon --config FILE``: the trainer daemon, serving workers on other processes or machines.

Store + proxy + embedded engine + learner, waiting for workers (``lightning-sdk run MODULE:AGENT --server URL``).
Binds the port first (a bad or busy one is a one-line error), prints the URL and the admin key as soon as the
proxy listens, warm-starts if configured, enqueues the config's train tasks and trains ``rl.steps`` steps on the
groups the workers finish. SIGINT/SIGTERM stop gracefully after the current step (checkpointed; the proxy stops
last) and exit 0; a second signal exits at once. Re-running with the same ``--output`` resumes.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import typer
from rich.console import Console

from lightning_sdk.cli._app import app
from lightning_sdk.errors import ConfigError, LightningSDKError

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
    ray: str | None = typer.Option(
        None,
        "--ray",
        help="Place the engines and agent workers on this Ray cluster ('auto' or HOST:PORT; [cluster] in the config).",
    ),
) -> None:
    """Run the trainer daemon: a proxy and a trainer that wait for agent workers."""
    from lightning_sdk.app import RunStopped, run_daemon
    from lightning_sdk.app.view import ProgressView
    from lightning_sdk.trainer.config import load_train_config
    from lightning_sdk.trainer.stopping import GracefulStop

    console = Console(stderr=True)
    overrides: dict[str, object] = {}
    if host:
        overrides["host"] = host
    if port is not None:
        overrides["port"] = port
    if ray:
        overrides["cluster.ray"] = ray
    stop = GracefulStop(note=lambda message: console.print(message, markup=False))

    def ready(url: str, key: str) -> None:
        console.print(f"trainer daemon ready: {url}", markup=False)
        console.print(f"admin key: {key}", markup=False)
        console.print(f"workers: lightning-sdk run MODULE:AGENT --server {url} --workers N", markup=False)

    async def main() -> dict[str, object]:
        stop.install()
        with ProgressView(cfg.name, cfg.rl.steps, console=console) as view:
            return await run_daemon(cfg, run_dir, admin_key=admin_key, view=view, on_ready=ready, stop=stop)

    try:
        if port is not None and not 0 <= port <= 65535:
            raise ConfigError(f"--port {port} is not a TCP port (0-65535)")
        cfg = load_train_config(config, overrides)
        run_dir = output or Path("runs") / f"{cfg.name}-daemon-{time.strftime('%Y%m%d-%H%M%S')}"
        result = asyncio.run(main())
    except RunStopped as exc:
        console.print(f"{exc}; re-run with the same --output ({run_dir}) to resume", markup=False)
        return
    except LightningSDKError as exc:
        console.print(f"error: {exc}", markup=False)
        raise typer.Exit(1) from None
    console.print(f"{result['steps']} steps; model: {result['model_dir']}", markup=False)
