"""``lightning-sdk train CONFIG_OR_EXAMPLE_DIR [--output RUN_DIR]``: the main job in one command.

Store + proxy + embedded engine + learner + in-process agent workers; warm start, held-out evaluation before and
after, async RL with a live view; ``RUN_DIR`` ends with ``summary.json``, ``metrics.jsonl``, ``reward_curve.png``,
TensorBoard logs and the trained model in ``RUN_DIR/model``. Re-running with the same ``--output`` resumes.
``--view`` serves the run viewer (``lightning-sdk view``) on ``--view-port`` during the run and prints its URL.

SIGINT/SIGTERM stop gracefully (workers release their attempts, the learner checkpoints its step, the proxy stops
last) and exit with ``128 + signal`` (130 / 143); a second signal exits at once.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from lightning_sdk.cli._app import app
from lightning_sdk.errors import LightningSDKError

__all__ = ["train_command"]


def _parse_set(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"--set expects KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


@app.command("train")
def train_command(
    config: Path = typer.Argument(..., help="A training config (TOML/YAML/JSON) or an example directory holding one."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Run directory (default: runs/NAME-TIME)."),
    set_: list[str] = typer.Option([], "--set", help="Override a config value, e.g. --set rl.steps=10 (repeatable)."),
    view: bool = typer.Option(False, "--view", help="Serve the run viewer during the run and print its URL."),
    view_port: int = typer.Option(4800, "--view-port", help="The viewer's port with --view (0: a free one)."),
) -> None:
    """Train an agent with RL: warm start, evaluate, train asynchronously, evaluate again."""
    from lightning_sdk.app import RunStopped, run_training
    from lightning_sdk.app.view import ProgressView
    from lightning_sdk.trainer.config import load_train_config
    from lightning_sdk.trainer.stopping import GracefulStop
    from lightning_sdk.viewer.serve import ViewerThread

    console = Console(stderr=True)
    stop = GracefulStop(note=lambda message: console.print(message, markup=False))

    async def main(progress: ProgressView) -> dict[str, Any]:
        stop.install()
        return await run_training(cfg, run_dir, view=progress, stop=stop)

    viewer: ViewerThread | None = None

    try:
        cfg = load_train_config(config, _parse_set(set_))
        run_dir = output or Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        if view:
            viewer = ViewerThread(run_dir, host=cfg.host, port=view_port).start()
            console.print(f"run viewer: {viewer.url}", markup=False, highlight=False)
        with ProgressView(cfg.name, cfg.rl.steps, console=console) as progress:
            summary = asyncio.run(main(progress))
    except RunStopped as exc:
        console.print(f"{exc}; re-run with the same --output ({run_dir}) to resume", markup=False)
        raise typer.Exit(stop.exit_code) from None
    except LightningSDKError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        console.print("interrupted; re-run with the same --output to resume")
        raise typer.Exit(130) from None
    finally:
        if viewer is not None:
            viewer.stop()
    before, after = summary["eval_before"], summary["eval_after"]
    if before["success_rate"] is not None and after["success_rate"] is not None:
        console.print(
            f"held-out success: {100 * before['success_rate']:.1f}% -> {100 * after['success_rate']:.1f}% "
            f"(n={after['n']}, {summary['eval_sampling']})"
        )
    console.print(f"{summary['steps']} steps in {summary['wall_s']:.0f} s; trained model: {summary['model_dir']}")
    console.print(f"summary: {Path(run_dir) / 'summary.json'}")
