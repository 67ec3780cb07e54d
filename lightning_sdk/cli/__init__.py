"""The ``lightning-sdk`` command: ``train``, ``daemon``, ``run``, ``proxy``, ``records`` and ``view``.

Each command lives in its own ``*_cmd`` module and registers itself on the shared typer ``app``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

from lightning_sdk.cli._app import app

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


def _limit_malloc_arenas(arenas: int = 2) -> None:
    """Cap glibc's malloc arenas unless the user set ``MALLOC_ARENA_MAX`` (and fix its mmap threshold, see below).

    The trainer frees and reallocates differently shaped tensors from many threads (engine batches, learner
    micro-batches, workers); with glibc's default of 8 arenas per core the freed memory stays spread over arenas and
    the resident size of ``lightning-sdk train`` on the calc example grew to 6 GB after 12 RL steps. Two arenas
    measured 3 GB at the same speed. Must run before threads start (arenas are created lazily)."""
    if not sys.platform.startswith("linux") or "MALLOC_ARENA_MAX" in os.environ:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, ...): nothing to tune
        return
    m_arena_max = -8  # from glibc's malloc.h
    libc.mallopt(m_arena_max, arenas)
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # A fixed mmap threshold: glibc otherwise raises it (up to 32 MB) each time a large block is freed, after
        # which the learner's and the engine's tensors come from the heap and their freed pages stay resident. With
        # 1 MiB fixed, every tensor of 1 MiB or more is mapped and unmapped: the main job peaked at 1.1 GB instead
        # of 2.1 GB (a short run, same wall time).
        m_mmap_threshold = -3
        libc.mallopt(m_mmap_threshold, 1 << 20)


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
    _limit_malloc_arenas()
    passive_openmp()
    logging.basicConfig(
        level=os.environ.get("LIGHTNING_SDK_LOG_LEVEL", "WARNING").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    _register()
    app()
