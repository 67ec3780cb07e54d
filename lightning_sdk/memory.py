"""glibc malloc settings of the ``lightning-sdk`` process: arenas and the mmap threshold.

The trainer frees and reallocates differently shaped tensors from many threads (engine batches, learner
micro-batches, workers). Two settings of glibc's allocator decide how much of that stays resident and what it costs:

- **Arenas** (``M_ARENA_MAX``): with glibc's default of 8 arenas per core the freed memory stays spread over arenas;
  the resident size of ``lightning-sdk train`` on the calc example grew to 6 GB after 12 RL steps, 3 GB with two.
- **The mmap threshold** (``M_MMAP_THRESHOLD``): blocks of at least this size are mapped on allocation and unmapped
  when freed. glibc raises it (up to 32 MiB) each time such a block is freed, after which tensors come from the heap
  and their freed pages stay resident. Fixed at 1 MiB, the tiny calc policy's run peaked at 1.1 GB instead of
  2.1 GB at the same wall time.

The price of 1 MiB is page faults: a mapped block's pages are faulted in and zeroed on first touch. For SmolLM2-135M
at a 5.7k-token context (the codex example's warm start: 4 rows under a shared prompt, LoRA, bf16) the forward of a
step took 18-20 s at 1 MiB against 11-12 s at 32 MiB (runs interleaved, 2-core Xeon, 2026-12-06), the backward the
same (~25 s); but the whole codex example at 32 MiB peaked at 17.6 GB RSS instead of ~10 GB and its warm start was
no faster (342 s vs 355 s), so a large policy keeps 1 MiB.

A small policy does not (``tune_for_policy``, called once the job's policy is loaded): the tiny calc policy's
tensors that come and go thousands of times a minute (a prefill's activations, the engine's batch caches, the
learner's micro-batches) are 1-8 MiB, so under a 1 MiB threshold every one of them was mapped, faulted in page by
page and unmapped: 20 million page faults in two minutes of ``lightning-sdk train examples/calc_agent``, a quarter
of the process's CPU time spent in the kernel (47 of 178 s). For a policy under ``SMALL_POLICY_PARAMETERS`` the
threshold goes to ``SMALL_POLICY_MMAP_THRESHOLD`` (8 MiB) and glibc keeps up to ``SMALL_POLICY_TRIM_THRESHOLD``
(64 MiB) of free heap before giving it back (``M_TRIM_THRESHOLD``; glibc's 128 KiB default once a threshold is
fixed returned and re-faulted the heap's top at every step): 0.5 million faults, 7 s in the kernel, the warm
start's 42 steps in 26 s instead of 47 s and an RL step ~7 s instead of ~9 s (2-core Xeon, 2026-12-06, issue 25;
docs/development.md, thirteenth round). ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` /
``MALLOC_ARENA_MAX`` in the environment always win (glibc reads them at start; nothing here overrides them).
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = [
    "MMAP_THRESHOLD",
    "SMALL_POLICY_MMAP_THRESHOLD",
    "SMALL_POLICY_PARAMETERS",
    "SMALL_POLICY_TRIM_THRESHOLD",
    "limit_malloc",
    "malloc_settings",
    "mmap_threshold",
    "set_mmap_threshold",
    "set_trim_threshold",
    "tune_for_policy",
]

MMAP_THRESHOLD = 1 << 20
"""1 MiB: every block of 1 MiB or more is mapped when allocated and unmapped when freed."""

SMALL_POLICY_PARAMETERS = 50_000_000
"""Policies with fewer parameters than this get ``SMALL_POLICY_MMAP_THRESHOLD`` and ``SMALL_POLICY_TRIM_THRESHOLD``
(``tune_for_policy``); SmolLM2-135M and larger keep 1 MiB."""

SMALL_POLICY_MMAP_THRESHOLD = 8 << 20
"""8 MiB: a small policy's tensors that come and go at every step (1-8 MiB) stay in the heap."""

SMALL_POLICY_TRIM_THRESHOLD = 64 << 20
"""64 MiB of free heap top kept (per arena) before glibc returns it to the kernel."""

_M_TRIM_THRESHOLD = -1  # from glibc's malloc.h
_M_ARENA_MAX = -8
_M_MMAP_THRESHOLD = -3

_state: dict[str, int | None] = {"threshold": None, "trim": None}  # what this module set (None: never set)


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, ...): nothing to tune
        return None


def set_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` for this process; False where there is no glibc to tell or the user
    chose one (``MALLOC_MMAP_THRESHOLD_``)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    libc = _libc()
    if libc is None or libc.mallopt(_M_MMAP_THRESHOLD, int(nbytes)) != 1:
        return False
    _state["threshold"] = int(nbytes)
    return True


def mmap_threshold() -> int | None:
    """The threshold this module last set (None: it never set one)."""
    return _state["threshold"]


def set_trim_threshold(nbytes: int) -> bool:
    """Let glibc keep up to ``nbytes`` of free memory at the top of each heap before returning it to the kernel;
    False where there is no glibc to tell or the user chose one (``MALLOC_TRIM_THRESHOLD_``)."""
    if "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    libc = _libc()
    if libc is None or libc.mallopt(_M_TRIM_THRESHOLD, int(nbytes)) != 1:
        return False
    _state["trim"] = int(nbytes)
    return True


def tune_for_policy(parameters: int) -> dict[str, int | None]:
    """Once the policy is loaded: with fewer than ``SMALL_POLICY_PARAMETERS`` parameters, the mmap threshold goes to
    ``SMALL_POLICY_MMAP_THRESHOLD`` and the trim threshold to ``SMALL_POLICY_TRIM_THRESHOLD`` (the trim threshold
    unless the user set ``MALLOC_TRIM_THRESHOLD_``); a larger policy keeps what ``limit_malloc`` set. Only a process
    whose threshold ``limit_malloc`` fixed at start is tuned: where the user set ``MALLOC_MMAP_THRESHOLD_`` or
    ``MALLOC_ARENA_MAX``, or nothing called ``limit_malloc`` (a library use), malloc stays as it is. Returns
    ``malloc_settings()``."""
    if _state["threshold"] is not None and 0 < parameters < SMALL_POLICY_PARAMETERS:
        set_mmap_threshold(SMALL_POLICY_MMAP_THRESHOLD)
        set_trim_threshold(SMALL_POLICY_TRIM_THRESHOLD)
    return malloc_settings()


def malloc_settings() -> dict[str, int | None]:
    """What this module set: ``mmap_threshold`` and ``trim_threshold`` in bytes (None: left to glibc or the
    environment); ``summary.json`` records it."""
    return {"mmap_threshold": _state["threshold"], "trim_threshold": _state["trim"]}


def limit_malloc(arenas: int = 2) -> None:
    """At process start: cap the arenas at ``arenas`` unless ``MALLOC_ARENA_MAX`` is set, and fix the mmap threshold
    at ``MMAP_THRESHOLD`` unless ``MALLOC_MMAP_THRESHOLD_`` is set. Must run before threads start (arenas are
    created lazily)."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return
    libc = _libc()
    if libc is None:
        return
    libc.mallopt(_M_ARENA_MAX, arenas)
    set_mmap_threshold(MMAP_THRESHOLD)
