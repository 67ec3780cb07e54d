"""Graceful stop on SIGINT/SIGTERM for ``lightning-sdk train`` and ``lightning-sdk daemon``.

The first signal only sets a flag that the run polls (``stop()``): the workers release their in-flight attempts,
the learner finishes its step and checkpoints it, and the proxy stops last, so no agent is left calling a closed
server. A second signal exits at once (``128 + signal``) for when a graceful stop takes too long.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable

__all__ = ["GracefulStop"]

logger = logging.getLogger(__name__)


class GracefulStop:
    """A stop flag set by SIGINT/SIGTERM; call it (``stop()``) to read it. ``install`` must run on the event loop."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, note: Callable[[str], None] | None = None) -> None:
        self.signal: int | None = None
        self._note = note

    def __call__(self) -> bool:
        return self.signal is not None

    @property
    def exit_code(self) -> int:
        """``128 + signal`` (130 for SIGINT, 143 for SIGTERM), the shell's convention; 1 without a signal."""
        return 128 + self.signal if self.signal is not None else 1

    def install(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        loop = loop or asyncio.get_running_loop()
        for sig in self.SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, int(sig))

    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self.signal is not None:
            logger.warning("%s again: exiting now", name)
            os._exit(128 + sig)
        self.signal = sig
        message = f"{name}: stopping after the current step (send it again to exit at once)"
        logger.info(message)
        if self._note is not None:
            self._note(message)
