"""``python -m lightning_sdk`` is the ``lightning-sdk`` command."""

from lightning_sdk.cli import main

main()
