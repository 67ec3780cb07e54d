"""The typer application behind the ``lightning-sdk`` command; each command lives in its own module."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="lightning-sdk",
    help="Train the LLM agents you already have with reinforcement learning.",
    no_args_is_help=True,
    add_completion=False,
)
