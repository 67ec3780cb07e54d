"""The ``lightning-sdk`` command: ``train``, ``daemon``, ``run``, ``proxy`` and ``records``.

Each command lives in its own ``*_cmd`` module and registers itself on the shared typer ``app``.
"""

from __future__ import annotations

import logging
import os

from lightning_sdk.cli._app import app

__all__ = ["app", "main"]


def _register() -> None:
    # Imported for their side effect: each module adds its command to ``app``.
    from lightning_sdk.cli import daemon_cmd, proxy_cmd, records_cmd, run_cmd, train_cmd  # noqa: F401


def main() -> None:
    """Entry point of the ``lightning-sdk`` console script."""
    logging.basicConfig(
        level=os.environ.get("LIGHTNING_SDK_LOG_LEVEL", "WARNING").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    _register()
    app()
