"""Sandbox process starts from a large parent: the ``sh`` + ``prlimit`` launcher (vfork) vs a ``preexec_fn`` (fork),
and the per-sandbox-user isolation's launcher (namespaces, the view's mounts, pivot_root, setpriv, prlimit).

    python benchmarks/sandbox_spawn.py [--parent-mb 1500] [--starts 20]

The parent first touches ``--parent-mb`` MB (the trainer is ~1.5 GB: torch, the policy, the engine), then starts
``true`` in one sandbox ``--starts`` times through ``LocalSandbox.exec`` with each way of applying the limits. A
``preexec_fn`` makes ``subprocess`` fork the whole parent (its page tables are copied, and the event loop that
called it waits); the launchers let it use vfork. Prints wall and CPU per start and the ratio to ``preexec``.
Target: the launcher >= 10x cheaper than ``preexec`` in wall time per start at 1.5 GB; ``isolated`` (the default
where root) is the cost of a start as a sandbox sees it (``shared-user`` is ``launcher``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import tempfile
import time

import lightning_sdk.sandbox._local as local
from lightning_sdk.sandbox import LocalBackend, SandboxLimits


def _cpu() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


async def _measure(starts: int, isolation: str) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as root:
        backend = LocalBackend(root=root, max_sandboxes=2, isolation=isolation)
        async with await backend.create({"a.txt": "x"}, SandboxLimits(wall_s=600)) as box:
            t0, c0 = time.perf_counter(), _cpu()
            for _ in range(starts):
                result = await box.exec(["true"], timeout=30)
                assert result.exit_code == 0, result
            return (time.perf_counter() - t0) / starts, (_cpu() - c0) / starts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--parent-mb", type=int, default=1500)
    parser.add_argument("--starts", type=int, default=20)
    args = parser.parse_args()
    ballast = bytearray(args.parent_mb * 1024 * 1024)
    for i in range(0, len(ballast), 4096):  # touch every page: resident, like the trainer's memory
        ballast[i] = 1
    local._probe()
    launcher = local._LAUNCH
    if launcher is None:
        raise SystemExit("sh or prlimit is missing here: the sandbox falls back to preexec_fn, nothing to compare")
    results = {}
    modes = ["preexec", "launcher"] + (["isolated"] if local.user_isolation_unavailable() is None else [])
    for mode in modes:
        local._LAUNCH = None if mode == "preexec" else launcher
        isolation = local.ISOLATION_USER if mode == "isolated" else local.ISOLATION_SHARED
        results[mode] = asyncio.run(_measure(args.starts, isolation))
    local._LAUNCH = launcher
    base_wall = results["preexec"][0]
    print(f"parent {args.parent_mb} MB resident, {args.starts} starts each, load {os.getloadavg()[0]:.1f}")
    for mode, (wall, cpu) in results.items():
        print(f"{mode:9s} {1000 * wall:7.1f} ms wall {1000 * cpu:6.1f} ms CPU per start  ({base_wall / wall:.1f}x)")


if __name__ == "__main__":
    main()
