"""The ``lightning-sdk`` command: ``train``, ``daemon``, ``run``, ``proxy``, ``records`` and ``view``.

Each command lives in its own ``*_cmd`` module and registers itself on the shared typer ``app``.
"""

from __future__ import annotations

import logging
import os

from lightning_sdk.cli._app import app
from lightning_sdk.memory import limit_malloc

__all__ = ["OPENMP_MARK", "app", "main", "passive_openmp"]


def _register() -> None:
    # Imported for their side effect: each module adds its command to ``app``.
    from lightning_sdk.cli import (  # noqa: F401
        daemon_cmd,
        proxy_cmd,
        records_cmd,
        run_cmd,
        setup_cmd,
        train_cmd,
        view_cmd,
    )


OPENMP_MARK = "LIGHTNING_SDK_SET_OMP_WAIT_POLICY"
"""Set (to ``1``) when ``OMP_WAIT_POLICY`` was chosen here, so engine servers started from this process
(``engines/launch.py``) get their own default instead."""


def passive_openmp() -> None:
    """Make torch's OpenMP threads (libgomp) sleep instead of spinning between parallel regions, unless the user
    chose (``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` set). Must run before torch is imported (libgomp reads it once).

    In ``lightning-sdk train`` the engine's thread, the learner's thread and the event loop (proxy, store, agents)
    share the cores; by default libgomp spins up to 300,000 times at every barrier while its team fits the cores,
    so a spinning OpenMP thread takes the CPU the other threads need, and on a shared machine the team itself waits
    for its descheduled members. Measured on the 2-core machine under load (average 7-9, the calc policy,
    ``benchmarks/engine_throughput.py``'s workload): the engine alone 28-40 tok/s spinning vs 829 passive (448
    with a 1,000 spin count), a learner forward+backward loop alone 0.2-0.3 vs 2.3-2.8 iterations/s, both together
    263-350 tok/s + 1.5-2.3 it/s vs 332 tok/s + 2.2 it/s. ``GOMP_SPINCOUNT=300000`` restores libgomp's default."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ[OPENMP_MARK] = "1"


def main() -> None:
    """Entry point of the ``lightning-sdk`` console script."""
    limit_malloc()  # lightning_sdk/memory.py: two arenas, a 1 MiB mmap threshold
    passive_openmp()
    logging.basicConfig(
        level=os.environ.get("LIGHTNING_SDK_LOG_LEVEL", "WARNING").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    _register()
    app()
