"""benchmarks/main_job.py's ``TreeMemory``: the peak memory of the command and all its processes together (a
learner child beside the main process), each counted by its proportional set size. Real processes: a parent that
touches 150 MB, then forks a child that keeps those pages shared and touches 100 MB of its own. And its CPU line
(``cpu_line``), which the report's figures are read against."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.scripts import load_script
from tests.trainer.tiny import ROOT

_TREE = r"""
import os, sys
shared = bytearray(150 * 1024 * 1024)
shared[::4096] = b"x" * len(shared[::4096])
r, w = os.pipe()
pid = os.fork()
if pid == 0:  # the child: the parent's 150 MB stay shared (never written here), 100 MB of its own
    own = bytearray(100 * 1024 * 1024)
    own[::4096] = b"y" * len(own[::4096])
    os.write(w, b"1")
    sys.stdin.read()  # until the test closes stdin
    os._exit(0)
os.read(r, 1)
print(pid, flush=True)
sys.stdin.read()
os.waitpid(pid, 0)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TreeMemory reads Linux's /proc")
def test_the_tree_counts_every_process_and_shared_pages_once() -> None:
    main_job = load_script(ROOT / "benchmarks" / "main_job.py", "main_job")
    proc = subprocess.Popen([sys.executable, "-c", _TREE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        child = int(proc.stdout.readline())  # both have touched their memory
        tree = main_job.TreeMemory(proc.pid)
        assert sorted(tree.processes()) == sorted([proc.pid, child])
        sample = tree.sample()
        assert sample is not None
        pss, rss = sample
        # 150 MB shared + 100 MB the child's own + two interpreters (~10 MB each): counted once, not 400 MB
        assert 250 <= pss <= 320, sample
        assert rss - pss >= 120, sample  # a plain sum of resident sets counts the shared 150 MB twice
        assert tree.peak_mb == pss
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    assert main_job.TreeMemory(proc.pid).sample() == (0.0, 0.0)  # gone: nothing counted


_LSCPU = """#!/bin/sh
cat <<'OUT'
Architecture:                            x86_64
Model name:                              AMD EPYC
CPU family:                              25
Model:                                   17
Flags:                                   fpu sse2 avx2 fma avx512f avx512_bf16 avx512_vnni
OUT
"""


def test_the_cpu_line_names_the_family_and_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two machines named "AMD EPYC" (family 25 model 1, AVX2 only; model 17, AVX-512 BF16) ran the main job a third
    apart: the report's CPU line must tell them apart. A stand-in ``lscpu`` on PATH prints lscpu's own fields."""
    main_job = load_script(ROOT / "benchmarks" / "main_job.py", "main_job")
    lscpu = tmp_path / "lscpu"
    lscpu.write_text(_LSCPU)
    lscpu.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    line = main_job.cpu_line()
    assert line.startswith("cpu: AMD EPYC (cpu family 25, model 17), ")
    assert line.endswith("; flags: avx2 fma avx512f avx512_bf16 avx512_vnni")
    # no family or model line (another lscpu, another architecture): the name alone
    lscpu.write_text("\n".join(line for line in _LSCPU.splitlines() if not line.startswith(("CPU family", "Model:"))))
    assert main_job.cpu_line().startswith("cpu: AMD EPYC, ")
