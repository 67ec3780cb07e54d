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
learner's packed micro-batches, the warm start's steps) are 1-8 MiB, so under a 1 MiB threshold every one of them
was mapped, faulted in page by page and unmapped: 20 million page faults in two minutes of ``lightning-sdk train
examples/calc_agent``, a quarter of the process's CPU time spent in the kernel (2-core Xeon, 2026-12-06; on a 2-core
AMD EPYC without AVX-512 a warm-start step took 0.72 s on two threads against 0.47 s at 8 MiB, a learner step of the
job's real batches 7.2 s against 3.9 s: docs/development.md, sixteenth round). So a policy under
``SMALL_POLICY_PARAMETERS`` runs the whole job (warm start and RL) at ``SMALL_POLICY_MMAP_THRESHOLD`` (8 MiB).

Kept in the heap, though, those blocks fragment it (they sit beside the engine's long-lived prefix-cache entries):
RL at 8 MiB alone peaked at 1.48-1.57 GB RSS on the Xeon (1.21-1.28 GB at 1 MiB, thirteenth round) and 1.40-1.45
GB on the EPYC. So after each learner step, and at the warm start's end, a small policy's free heap goes back to the
kernel (``release_free_heap``: ``malloc_trim``, which also returns the free pages inside the heap, not only its
top): the pages a step freed are faulted in again once by the next step (not once per tensor as under 1 MiB), and
the main job on the EPYC peaked at 1.33 GB (1.36 GB at 1 MiB) with the warm start at 31-40 s instead of 64 s and the
learner's CPU per trained token -33%. A step still freed 400-500 MB into the heap before its end and one run
peaked at 1.47 GB, so while the job runs ``guard_resident`` also trims whenever the process is above
``RESIDENT_GUARD`` (1.2 GiB). ``summary.json`` (``malloc``) records the threshold, how many trims ran and what
they gave back.

``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_ARENA_MAX`` in the environment always win (glibc
reads them at start; nothing here overrides them).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import os
import sys
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MMAP_THRESHOLD",
    "RESIDENT_GUARD",
    "SMALL_POLICY_MMAP_THRESHOLD",
    "SMALL_POLICY_PARAMETERS",
    "guard_resident",
    "guard_step",
    "limit_malloc",
    "malloc_settings",
    "mmap_threshold",
    "release_free_heap",
    "resident_bytes",
    "set_mmap_threshold",
    "tune_for_policy",
]

MMAP_THRESHOLD = 1 << 20
"""1 MiB: every block of 1 MiB or more is mapped when allocated and unmapped when freed."""

SMALL_POLICY_PARAMETERS = 50_000_000
"""Policies with fewer parameters than this run at ``SMALL_POLICY_MMAP_THRESHOLD`` and give their free heap back
after each learner step (``release_free_heap``); SmolLM2-135M and larger keep 1 MiB."""

SMALL_POLICY_MMAP_THRESHOLD = 8 << 20
"""8 MiB: a small policy's step tensors (1-8 MiB) come from the heap (``tune_for_policy``)."""

_M_ARENA_MAX = -8  # from glibc's malloc.h
_M_MMAP_THRESHOLD = -3


@dataclass
class _Settings:
    """What this module set in this process (None: never set)."""

    threshold: int | None = None
    small_policy: bool = False  # tune_for_policy found a small policy (and set its threshold)
    trims: int = 0  # release_free_heap's trims
    guard_trims: int = 0  # of which guard_resident's
    released: int = 0  # the resident bytes they gave back


_state = _Settings()


@functools.cache  # one handle for the process: the guard and each learner step ask for it
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, ...): nothing to tune
        return None


def _set(option: int, env: str, key: str, nbytes: int) -> bool:
    """``mallopt(option, nbytes)`` unless the user set ``env``; remembers it as ``_state.<key>``."""
    if env in os.environ:
        return False
    libc = _libc()
    if libc is None or libc.mallopt(option, int(nbytes)) != 1:
        return False
    setattr(_state, key, int(nbytes))
    return True


def set_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` for this process; False where there is no glibc to tell or the user
    chose one (``MALLOC_MMAP_THRESHOLD_``)."""
    return _set(_M_MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_", "threshold", nbytes)


def mmap_threshold() -> int | None:
    """The threshold this module last set (None: it never set one)."""
    return _state.threshold


def tune_for_policy(parameters: int) -> dict[str, Any]:
    """Once the policy is loaded: a policy with fewer than ``SMALL_POLICY_PARAMETERS`` parameters is small, and the
    process's mmap threshold goes to ``SMALL_POLICY_MMAP_THRESHOLD`` (its step tensors from the heap), its free heap
    given back after each learner step (``release_free_heap``). Only a process whose threshold ``limit_malloc`` fixed
    at start is tuned: where the user set ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_ARENA_MAX``, or nothing called
    ``limit_malloc`` (a library use), malloc stays as it is. Returns ``malloc_settings()``."""
    small = _state.threshold is not None and 0 < parameters < SMALL_POLICY_PARAMETERS
    _state.small_policy = small and set_mmap_threshold(SMALL_POLICY_MMAP_THRESHOLD)
    return malloc_settings()


def resident_bytes() -> int:
    """This process's resident set size (``/proc/self/statm``; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def release_free_heap() -> int | None:
    """For a small policy (``tune_for_policy``), after a learner step or the warm start: give the heap's free pages
    back to the kernel (``malloc_trim(0)``: all arenas, inside the heaps as well as their tops). Returns the resident
    bytes that went (None: not a small policy's process, nothing done)."""
    libc = _libc() if _state.small_policy else None
    if libc is None:
        return None
    before = resident_bytes()
    libc.malloc_trim(0)
    released = max(0, before - resident_bytes())
    _state.trims += 1
    _state.released += released
    return released


RESIDENT_GUARD = 1200 << 20
"""1.2 GiB: above this resident size a small policy's process gives its free heap back at once (``guard_resident``),
not only after the learner's next step."""


def guard_step(limit: int = RESIDENT_GUARD, every_s: float = 0.25, backoff_s: float = 5.0) -> float:
    """One look of ``guard_resident``: above ``limit`` resident bytes, ``release_free_heap``. Returns the seconds to
    wait before the next look: ``every_s``, or ``backoff_s`` after a trim that gave back less than 32 MiB (what is
    resident is live: a process that is simply that large is not trimmed four times a second)."""
    if resident_bytes() <= limit:
        return every_s
    released = release_free_heap()
    if released is None:
        return every_s
    _state.guard_trims += 1
    return backoff_s if released < 32 << 20 else every_s


async def guard_resident(limit: int = RESIDENT_GUARD, every_s: float = 0.25, backoff_s: float = 5.0) -> None:
    """For a small policy's job, until cancelled: a ``guard_step`` every ``every_s`` seconds (in a worker thread).
    Between learner steps the engine's and the learner's freed blocks pile up in the heap (400-500 MB a step in the
    calc example), and the peak comes within a step, not at its end. Returns at once for any other process."""
    if not _state.small_policy:
        return
    wait = every_s
    while True:
        await asyncio.sleep(wait)
        wait = await asyncio.to_thread(guard_step, limit, every_s, backoff_s)


def malloc_settings() -> dict[str, Any]:
    """What this module set: ``mmap_threshold`` in bytes now (None: left to glibc or the environment),
    ``small_policy`` (the small policy's settings in force), and ``trims`` / ``released_mb``: how often
    ``release_free_heap`` ran (``guard_trims`` of them by ``guard_resident``) and the resident MiB it gave back;
    ``summary.json`` records it."""
    return {
        "mmap_threshold": _state.threshold,
        "small_policy": _state.small_policy,
        "trims": _state.trims,
        "guard_trims": _state.guard_trims,
        "released_mb": _state.released >> 20,
    }


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
