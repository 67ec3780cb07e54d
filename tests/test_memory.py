"""lightning_sdk/memory.py: the arena cap and glibc's mmap threshold that ``lightning-sdk`` fixes at start.

Each case runs in a fresh interpreter (the setting is process-wide) and reads glibc's own count of mapped blocks
(``mallinfo2().hblks``) around a real ``malloc``: a 2 MiB block is mapped under the 1 MiB threshold, comes from
the heap under a user's 4 MiB, and a 64 KiB block is never mapped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from lightning_sdk.memory import MMAP_THRESHOLD

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")

# both probes: glibc's own count of mapped blocks (mallinfo2().hblks) around a real malloc
HEADER = textwrap.dedent(
    """
    import ctypes, json, sys
    from lightning_sdk import memory

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]

    def mapped_by_malloc(nbytes):
        before = libc.mallinfo2().hblks
        p = libc.malloc(nbytes)
        after = libc.mallinfo2().hblks
        libc.free(p)
        return after > before
    """
)

PROBE = HEADER + textwrap.dedent(
    """

    out = {}
    memory.limit_malloc()
    out["start"] = memory.mmap_threshold()
    out["start_maps_2mib"] = mapped_by_malloc(2 << 20)
    out["start_maps_64kib"] = mapped_by_malloc(64 << 10)
    out["set_4mib"] = memory.set_mmap_threshold(4 << 20)
    out["after_set_maps_2mib"] = mapped_by_malloc(2 << 20)
    out["after_set"] = memory.mmap_threshold()
    print(json.dumps(out))
    """
)

# a policy of argv[1] parameters after limit_malloc: whether a 1.5 MiB and a 4 MiB block are mapped, and what
# release_free_heap gives back of 64 MiB of 512 KiB blocks (from the heap under any threshold here) touched and freed
# below one block still held (so the freed pages sit inside the heap, under its top, where only a trim of the whole
# heap reaches them)
TUNE = HEADER + textwrap.dedent(
    """
    from ctypes import memset

    out = {}
    memory.limit_malloc()
    out["settings"] = memory.tune_for_policy(int(sys.argv[1]))
    out["maps_1_5mib"] = mapped_by_malloc(3 << 19)
    out["maps_4mib"] = mapped_by_malloc(4 << 20)
    blocks = [libc.malloc(512 << 10) for _ in range(128)]
    for b in blocks:
        memset(b, 1, 512 << 10)  # resident now
    held = libc.malloc(512 << 10)  # above them: their pages are not the heap's top
    memset(held, 1, 512 << 10)
    for b in blocks:
        libc.free(b)
    rss = memory.resident_bytes()
    out["released"] = memory.release_free_heap()
    out["rss_drop"] = rss - memory.resident_bytes()
    out["after"] = memory.malloc_settings()
    libc.free(held)
    print(json.dumps(out))
    """
)


def _probe(*args: str, code: str = PROBE, **env: str) -> dict[str, object]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", code, *args], env={**clean, **env}, capture_output=True, text=True, timeout=60,
        check=True,
    )  # fmt: skip
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_one_mib_at_start_and_a_later_setting_takes_effect() -> None:
    out = _probe()
    assert MMAP_THRESHOLD == 1 << 20
    assert out["start"] == MMAP_THRESHOLD
    assert out["start_maps_2mib"] is True  # 2 MiB >= 1 MiB: mapped
    assert out["start_maps_64kib"] is False
    assert out["set_4mib"] is True and out["after_set"] == 4 << 20
    assert out["after_set_maps_2mib"] is False  # from the heap now


def test_a_users_threshold_is_left_alone() -> None:
    out = _probe(MALLOC_MMAP_THRESHOLD_=str(4 << 20))
    assert out["start"] is None and out["set_4mib"] is False and out["after_set"] is None
    assert out["start_maps_2mib"] is False  # glibc read 4 MiB from the environment


def test_a_users_arena_cap_leaves_the_threshold_alone() -> None:
    out = _probe(MALLOC_ARENA_MAX="4")
    assert out["start"] is None
    assert out["start_maps_2mib"] is True  # glibc's own start threshold: 128 KiB


def test_a_small_policy_keeps_its_step_tensors_in_the_heap_and_gives_freed_pages_back() -> None:
    """The tiny calc policy (3.2M parameters): its 1.5 and 4 MiB step tensors come from the heap (no page faults
    when the next micro-batch allocates them again), and release_free_heap (after each learner step) returns the
    64 MiB freed inside the heap, which glibc's own trimming of the heap's top never reaches."""
    out = _probe("3200000", code=TUNE)
    none = {"trims": 0, "guard_trims": 0, "released_mb": 0}
    assert out["settings"] == {"mmap_threshold": 8 << 20, "small_policy": True, **none}
    assert out["maps_1_5mib"] is False and out["maps_4mib"] is False
    assert out["released"] >= 48 << 20, out
    assert out["rss_drop"] >= 48 << 20, out
    assert out["after"]["trims"] == 1 and out["after"]["released_mb"] >= 48


# the resident-size guard of a policy of argv[1] parameters: 64 MiB freed inside the heap, then two looks of the guard
# (limit 1 byte: always above it), and the guard itself (which returns at once unless the policy is small)
GUARD = HEADER + textwrap.dedent(
    """
    import asyncio
    from ctypes import memset

    memory.limit_malloc()
    memory.tune_for_policy(int(sys.argv[1]))
    blocks = [libc.malloc(512 << 10) for _ in range(128)]
    for b in blocks:
        memset(b, 1, 512 << 10)
    held = libc.malloc(512 << 10)
    memset(held, 1, 512 << 10)
    for b in blocks:
        libc.free(b)
    out = {"waits": [memory.guard_step(1, every_s=0.25, backoff_s=5.0) for _ in range(2)]}
    out["after"] = memory.malloc_settings()
    if not out["after"]["small_policy"]:
        asyncio.run(memory.guard_resident(1))  # returns at once (else this probe would never end)
    print(json.dumps(out))
    """
)


def test_the_guard_trims_above_its_limit_then_backs_off() -> None:
    """Above its limit the guard gives the 64 MiB back at once (not waiting for a learner step) and looks again after
    0.25 s; its next trim finds almost nothing to give back, and it waits its back-off (5 s) instead."""
    out = _probe("3200000", code=GUARD)
    assert out["waits"] == [0.25, 5.0]
    after = out["after"]
    assert after["guard_trims"] == 2 and after["trims"] == 2, after
    assert after["released_mb"] >= 48


def test_the_guard_leaves_a_large_policy_alone() -> None:
    out = _probe("135000000", code=GUARD)
    assert out["waits"] == [0.25, 0.25]
    assert out["after"]["guard_trims"] == 0 and out["after"]["trims"] == 0


def test_a_large_policy_keeps_one_mib_and_no_trims() -> None:
    out = _probe("135000000", code=TUNE)  # SmolLM2-135M
    none = {"trims": 0, "guard_trims": 0, "released_mb": 0}
    assert out["settings"] == {"mmap_threshold": MMAP_THRESHOLD, "small_policy": False, **none}
    assert out["maps_1_5mib"] is True and out["maps_4mib"] is True
    assert out["released"] is None and out["after"]["trims"] == 0


def test_a_users_settings_are_not_tuned() -> None:
    out = _probe("3200000", code=TUNE, MALLOC_ARENA_MAX="2")
    assert out["settings"]["mmap_threshold"] is None and out["settings"]["small_policy"] is False
    assert out["released"] is None
    out = _probe("3200000", code=TUNE, MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    assert out["settings"]["small_policy"] is False and out["maps_1_5mib"] is True
    assert out["released"] is None
