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

# a small policy's warm start after limit_malloc: outside it a 1.5 MiB block is mapped and glibc trims a freed heap
# top (the heap's size in mallinfo2().arena shrinks); inside warm_start_phase the block and a 4 MiB one come from the
# heap and a freed 32 MiB top stays; after it the block is mapped again and the phase's freed heap was returned
TUNE = HEADER + textwrap.dedent(
    """

    def heap_kept_after_free(nbytes):
        # 512 KiB blocks (below either threshold: from the heap), freed in reverse order: the heap's top is free
        blocks = [libc.malloc(512 << 10) for _ in range(nbytes >> 19)]
        grown = libc.mallinfo2().arena
        for b in reversed(blocks):
            libc.free(b)
        assert grown >= nbytes, grown
        return libc.mallinfo2().arena >= grown - (1 << 20)

    out = {}
    memory.limit_malloc()
    out["small"] = memory.tune_for_policy(int(sys.argv[1]))
    out["maps_1_5mib"] = mapped_by_malloc(3 << 19)
    out["keeps_heap_top"] = heap_kept_after_free(32 << 20)
    libc.malloc_trim(0)  # an empty heap top: whether a block is mapped is the threshold's decision
    with memory.warm_start_phase() as phase:
        out["phase"] = phase
        out["phase_settings"] = memory.malloc_settings()
        out["phase_maps_1_5mib"] = mapped_by_malloc(3 << 19)
        out["phase_maps_4mib"] = mapped_by_malloc(4 << 20)
        out["phase_keeps_heap_top"] = heap_kept_after_free(32 << 20)
        out["phase_heap"] = libc.mallinfo2().arena
    out["after_phase"] = memory.malloc_settings()
    out["after_phase_maps_1_5mib"] = mapped_by_malloc(3 << 19)
    out["after_phase_heap"] = libc.mallinfo2().arena
    print(json.dumps(out))
    """
)


def _probe(*args: str, code: str = PROBE, **env: str) -> dict[str, object]:
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LIGHTNING_SDK_WARM_START_MALLOC"
    }
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


def test_a_small_policy_warm_starts_with_its_step_tensors_in_the_heap() -> None:
    """The tiny calc policy (3.2M parameters): in the warm start 1.5 and 4 MiB blocks come from the heap and a freed
    32 MiB heap top stays (no page faults when the next step allocates them again); before and after it the
    1 MiB threshold and glibc's trim threshold hold, and the phase's free heap is given back at its end."""
    out = _probe("3200000", code=TUNE, LIGHTNING_SDK_WARM_START_MALLOC="1")
    one_mib = {"mmap_threshold": MMAP_THRESHOLD, "trim_threshold": None}
    assert out["small"] == {**one_mib, "warm_start": None}
    assert out["maps_1_5mib"] is True
    assert out["keeps_heap_top"] is False
    assert out["phase"] == 8 << 20
    warm = {"mmap_threshold": 8 << 20, "trim_threshold": 64 << 20}
    assert out["phase_settings"] == {**warm, "warm_start": warm}
    assert out["phase_maps_1_5mib"] is False and out["phase_maps_4mib"] is False
    assert out["phase_keeps_heap_top"] is True
    assert out["after_phase"] == {**one_mib, "warm_start": warm}
    assert out["after_phase_maps_1_5mib"] is True
    # malloc_trim gave the freed 32 MiB back: the heap shrank below what the phase left it at
    assert out["after_phase_heap"] <= out["phase_heap"] - (16 << 20), (out["phase_heap"], out["after_phase_heap"])


def test_the_warm_start_phase_is_off_unless_asked() -> None:
    """Off by default (the main job's peak RSS): the small policy's warm start keeps 1 MiB and glibc's trim."""
    out = _probe("3200000", code=TUNE)
    assert out["phase"] is None and out["phase_maps_1_5mib"] is True and out["phase_keeps_heap_top"] is False
    assert out["after_phase"]["warm_start"] is None


def test_a_large_policy_keeps_one_mib() -> None:
    out = _probe("135000000", code=TUNE, LIGHTNING_SDK_WARM_START_MALLOC="1")  # SmolLM2-135M
    assert out["small"] == {"mmap_threshold": MMAP_THRESHOLD, "trim_threshold": None, "warm_start": None}
    assert out["phase"] is None and out["phase_maps_1_5mib"] is True
    assert out["phase_keeps_heap_top"] is False


def test_a_users_settings_are_not_tuned() -> None:
    out = _probe("3200000", code=TUNE, MALLOC_ARENA_MAX="2", LIGHTNING_SDK_WARM_START_MALLOC="1")
    assert out["small"] == {"mmap_threshold": None, "trim_threshold": None, "warm_start": None}
    assert out["phase"] is None
    out = _probe("3200000", code=TUNE, MALLOC_MMAP_THRESHOLD_=str(1 << 20), LIGHTNING_SDK_WARM_START_MALLOC="1")
    assert out["phase"] is None and out["phase_maps_1_5mib"] is True
