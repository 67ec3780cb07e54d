"""``lightning-sdk view RUN_DIR [--host 127.0.0.1] [--port 4800] [--tokenizer DIR]``: the run viewer, read-only.

Serves the pages of ``lightning_sdk.viewer`` over ``RUN_DIR`` (the ``--output`` of ``lightning-sdk train`` or
``daemon``: ``summary.json``, ``metrics.jsonl``, ``store.db``, the model) until interrupted. The tokenizer that
decodes the records is the run's (``model``, ``policy_init`` or the configured model), unless ``--tokenizer`` names
one. Works on a run still going (the store is SQLite in WAL mode; the viewer only reads).
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from lightning_sdk.cli._app import app
from lightning_sdk.errors import LightningSDKError

__all__ = ["view"]


@app.command("view")
def view(
    run_dir: Path = typer.Argument(..., help="A run directory (the --output of lightning-sdk train or daemon)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to bind."),
    port: int = typer.Option(4800, "--port", help="Port to listen on (0: a free one)."),
    tokenizer: Path | None = typer.Option(None, "--tokenizer", help="Decode records with this tokenizer directory."),
) -> None:
    """Serve the run viewer for RUN_DIR: curves, steps, rollouts, calls, records and the fidelity report."""
    from lightning_sdk.viewer.serve import serve_viewer

    console = Console(stderr=True)
    try:
        serve_viewer(run_dir, host=host, port=port, tokenizer_dir=tokenizer, announce=console.print)
    except LightningSDKError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
