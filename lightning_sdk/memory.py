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
of the process's CPU time spent in the kernel (47 of 178 s). Measured on that job (2-core Xeon, 2026-12-06, issue
25; docs/development.md, thirteenth round):

- with ``LIGHTNING_SDK_WARM_START_MALLOC=1`` in the environment (off by default: see the RSS below), during a small
  policy's supervised warm start (``warm_start_phase``; a policy under ``SMALL_POLICY_PARAMETERS``, marked by
  ``tune_for_policy``) the threshold is ``WARM_START_MMAP_THRESHOLD`` (8 MiB) and glibc keeps up to
  ``WARM_START_TRIM_THRESHOLD`` (64 MiB) of free heap before giving it back (``M_TRIM_THRESHOLD``; its 128 KiB
  default once a threshold is fixed returned and re-faulted the heap's top at every step): a step's activations for
  32 demonstrations are 2-8 MiB each, and kept in the heap the warm start's 42 steps took 22-31 s instead of 44-50 s
  (0.3-0.5 million page faults instead of 20 million);
- not in RL: there the same blocks, kept beside the engine's long-lived prefix-cache entries, fragment the heap, and
  whole runs at 8 MiB peaked at 1.48-1.57 GB RSS (1.21-1.28 GB at 1 MiB) for RL steps only ~10% faster. At the warm
  start's end the thresholds go back to 1 MiB and glibc's default, and the free heap is returned (``malloc_trim``).
  Even so the heap the warm start left behind makes RL's small blocks land on pages all over it: whole runs with the
  phase peaked at 1,453-1,531 MB (1,201-1,307 MB without), over the main job's 1.5 GB budget in two of four, while
  their time to +30 (176-195 s) was no better than without (155-200 s: the faster steps needed more of them). Hence
  opt-in, for a machine with memory to spare.

``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_ARENA_MAX`` in the environment always win (glibc
reads them at start; nothing here overrides them).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MMAP_THRESHOLD",
    "SMALL_POLICY_PARAMETERS",
    "WARM_START_MMAP_THRESHOLD",
    "WARM_START_SWITCH",
    "WARM_START_TRIM_THRESHOLD",
    "limit_malloc",
    "malloc_settings",
    "mmap_threshold",
    "set_mmap_threshold",
    "set_trim_threshold",
    "tune_for_policy",
    "warm_start_phase",
]

MMAP_THRESHOLD = 1 << 20
"""1 MiB: every block of 1 MiB or more is mapped when allocated and unmapped when freed."""

SMALL_POLICY_PARAMETERS = 50_000_000
"""Policies with fewer parameters than this warm-start under ``WARM_START_MMAP_THRESHOLD`` and
``WARM_START_TRIM_THRESHOLD`` (``warm_start_phase``); SmolLM2-135M and larger keep 1 MiB."""

WARM_START_MMAP_THRESHOLD = 8 << 20
"""8 MiB: a small policy's supervised steps keep their 2-8 MiB activations in the heap."""

WARM_START_TRIM_THRESHOLD = 64 << 20
"""64 MiB of free heap top kept (per arena) during a small policy's warm start."""

WARM_START_SWITCH = "LIGHTNING_SDK_WARM_START_MALLOC"
"""The environment variable that turns ``warm_start_phase`` on ("1"); off by default (peak RSS, see above)."""

GLIBC_TRIM_THRESHOLD = 128 << 10
"""glibc's own trim threshold (128 KiB), put back after the warm start."""

_M_TRIM_THRESHOLD = -1  # from glibc's malloc.h
_M_ARENA_MAX = -8
_M_MMAP_THRESHOLD = -3


@dataclass
class _Settings:
    """What this module set in this process (None: never set)."""

    threshold: int | None = None
    trim: int | None = None
    small_policy: bool = False  # tune_for_policy found a small policy
    warm_start: dict[str, int | None] | None = None  # the last warm_start_phase's thresholds


_state = _Settings()


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


def set_trim_threshold(nbytes: int) -> bool:
    """Let glibc keep up to ``nbytes`` of free memory at the top of each heap before returning it to the kernel;
    False where there is no glibc to tell or the user chose one (``MALLOC_TRIM_THRESHOLD_``)."""
    return _set(_M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_", "trim", nbytes)


def tune_for_policy(parameters: int) -> dict[str, Any]:
    """Once the policy is loaded: a policy with fewer than ``SMALL_POLICY_PARAMETERS`` parameters is small, and its
    warm start runs under ``warm_start_phase``'s settings. Only a process whose threshold ``limit_malloc`` fixed at
    start is tuned: where the user set ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_ARENA_MAX``, or nothing called
    ``limit_malloc`` (a library use), malloc stays as it is. Returns ``malloc_settings()``."""
    _state.small_policy = _state.threshold is not None and 0 < parameters < SMALL_POLICY_PARAMETERS
    return malloc_settings()


@contextlib.contextmanager
def warm_start_phase() -> Iterator[int | None]:
    """With ``LIGHTNING_SDK_WARM_START_MALLOC=1``, around a small policy's supervised warm start: the mmap threshold
    at ``WARM_START_MMAP_THRESHOLD`` and the trim threshold at ``WARM_START_TRIM_THRESHOLD`` (unless the user set
    ``MALLOC_TRIM_THRESHOLD_``), then both back (the threshold to what it was, the trim threshold to glibc's 128 KiB)
    and the free heap returned to the kernel (``malloc_trim``). Yields the threshold in force (None: nothing changed:
    not a small policy, the user's own settings, or the switch off)."""
    before = _state.threshold
    wanted = os.environ.get(WARM_START_SWITCH, "") == "1"
    if not wanted or not _state.small_policy or before is None or not set_mmap_threshold(WARM_START_MMAP_THRESHOLD):
        yield None
        return
    trimmed = set_trim_threshold(WARM_START_TRIM_THRESHOLD)
    _state.warm_start = {"mmap_threshold": WARM_START_MMAP_THRESHOLD, "trim_threshold": _state.trim}
    try:
        yield WARM_START_MMAP_THRESHOLD
    finally:
        set_mmap_threshold(before)
        if trimmed:
            set_trim_threshold(GLIBC_TRIM_THRESHOLD)
            _state.trim = None  # glibc's own again
        libc = _libc()
        if libc is not None:
            libc.malloc_trim(0)


def malloc_settings() -> dict[str, Any]:
    """What this module set: ``mmap_threshold`` and ``trim_threshold`` in bytes now (None: left to glibc or the
    environment) and ``warm_start``, those of the last ``warm_start_phase`` (None: it changed nothing);
    ``summary.json`` records it."""
    return {"mmap_threshold": _state.threshold, "trim_threshold": _state.trim, "warm_start": _state.warm_start}


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
