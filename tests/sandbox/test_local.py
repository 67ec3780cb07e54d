"""The local-process sandbox backend, with real processes: every limit it claims is enforced, every way an attempt
can end leaves nothing behind (also a SIGKILLed owner, reaped by the next backend), and the cap holds."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lightning_sdk.sandbox import LocalBackend, SandboxError, SandboxLimits, describe_enforcement, reap_leftovers
from lightning_sdk.sandbox._local import _pids_of_uid, _pids_with_marker
from tests.support.waiting import until, until_async

PY = sys.executable
FILES = {"pkg/__init__.py": "", "pkg/mod.py": "def f(x):\n    return x + 1\n"}


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_dead(pid: int, timeout: float = 5.0) -> bool:
    try:
        until(lambda: not _alive(pid), timeout=timeout, what=f"process {pid} to end")
    except AssertionError:
        return False
    return True


@pytest.fixture
def backend(tmp_path: Path) -> LocalBackend:
    return LocalBackend(root=tmp_path / "boxes", max_sandboxes=4, create_timeout_s=5)


async def test_files_exec_snapshot_and_close(backend: LocalBackend) -> None:
    box = await backend.create(FILES, SandboxLimits(wall_s=60))
    assert Path(box.path, "pkg/mod.py").read_text() == FILES["pkg/mod.py"]
    res = await box.exec("sed -i 's/x + 1/x + 2/' pkg/mod.py && cat pkg/mod.py && pwd")
    assert res.exit_code == 0 and "return x + 2" in res.stdout
    assert res.stdout.strip().endswith(box.path)
    assert box.snapshot() == {"pkg/__init__.py": "", "pkg/mod.py": "def f(x):\n    return x + 2\n"}
    assert backend.active() == 1
    await box.close()
    await box.close()  # idempotent
    assert not Path(box.path).exists() and backend.active() == 0


async def test_output_is_truncated_and_exit_codes_kept(backend: LocalBackend) -> None:
    async with await backend.create(FILES, SandboxLimits(output_bytes=100)) as box:
        res = await box.exec([PY, "-c", "import sys; print('x' * 5000); sys.exit(3)"])
        assert res.exit_code == 3 and res.truncated and len(res.stdout) == 100


async def test_cpu_time_limit_kills_a_busy_loop(backend: LocalBackend) -> None:
    async with await backend.create(FILES, SandboxLimits(cpu_s=1)) as box:
        res = await box.exec([PY, "-c", "while True: pass"], timeout=60)
        assert not res.timed_out
        assert res.exit_code in (-signal.SIGXCPU, -signal.SIGKILL)


async def test_memory_limit_refuses_a_large_allocation(backend: LocalBackend) -> None:
    async with await backend.create(FILES, SandboxLimits(memory_mb=300)) as box:
        res = await box.exec([PY, "-c", "b = bytearray(600 * 1024 * 1024)"])
        assert res.exit_code != 0 and "MemoryError" in res.stderr
        ok = await box.exec([PY, "-c", "b = bytearray(20 * 1024 * 1024); print(len(b))"])
        assert ok.exit_code == 0 and ok.stdout.strip() == str(20 * 1024 * 1024)


async def test_file_size_limit(backend: LocalBackend) -> None:
    async with await backend.create(FILES, SandboxLimits(file_size_mb=1)) as box:
        res = await box.exec("head -c 3000000 /dev/zero > big.bin")
        assert res.exit_code != 0
        assert os.path.getsize(Path(box.path, "big.bin")) <= 1024 * 1024


async def test_process_count_limit(backend: LocalBackend) -> None:
    async with await backend.create(FILES, SandboxLimits(max_processes=8)) as box:
        script = "for i in $(seq 1 30); do sleep 5 & done; wait"
        res = await box.exec(script, timeout=20)
        assert "fork" in res.stderr.lower() or "resource temporarily unavailable" in res.stderr.lower(), res
        assert res.exit_code != 0 or res.stderr


async def test_wall_timeout_kills_the_process_group_including_grandchildren(backend: LocalBackend) -> None:
    async with await backend.create(FILES) as box:
        t0 = time.monotonic()
        res = await box.exec("sleep 60 & echo $!; sleep 60", timeout=0.5)
        assert res.timed_out and time.monotonic() - t0 < 10
        assert res.stdout.split()  # the grandchild started (its pid is its PID namespace's: look for it by marker)
        uid = box.uid
        until(lambda: not _pids_with_marker(box.id) and not (uid is not None and _pids_of_uid(uid)), timeout=5)


async def test_sandbox_wall_deadline_kills_started_programs(backend: LocalBackend) -> None:
    box = await backend.create(FILES, SandboxLimits(wall_s=0.5))
    proc = await box.start(["sleep", "60"])
    assert await asyncio.wait_for(proc.wait(), 10) == -signal.SIGKILL
    with pytest.raises(SandboxError, match="wall time"):
        await box.exec("true")
    await box.close()


@pytest.mark.skipif(not describe_enforcement()["network"].startswith("exec()"), reason="unshare -n not permitted")
async def test_exec_has_no_network_where_the_os_allows(backend: LocalBackend) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')"
    try:
        async with await backend.create(FILES) as box:
            res = await box.exec([PY, "-c", code])
            assert res.exit_code != 0 and "connected" not in res.stdout
            proc = await box.start([PY, "-c", code])  # a harness keeps the network (it must reach the proxy)
            out, _ = await proc.communicate()
            assert out.decode().strip() == "connected"
        open_box = await backend.create(FILES, SandboxLimits(network=True))
        res = await open_box.exec([PY, "-c", code])
        assert res.stdout.strip() == "connected"
        await open_box.close()
    finally:
        server.close()


async def test_close_kills_background_processes_and_removes_everything(backend: LocalBackend) -> None:
    box = await backend.create(FILES)
    proc = await box.start(["bash", "-c", "setsid sleep 60 & echo $!; sleep 60"])
    assert proc.stdout is not None
    assert int((await proc.stdout.readline()).decode())  # left the process group: found by cgroup / marker / uid
    cgroups, uid = list(box.cgroups), box.uid
    assert len(_pids_with_marker(box.id)) >= 3  # bash, its sleep and the escaped one
    await box.close()
    assert _wait_dead(proc.pid)
    until(lambda: not _pids_with_marker(box.id) and not (uid is not None and _pids_of_uid(uid)), timeout=5)
    assert not box.directory.exists()
    assert all(not Path(cg).exists() for cg in cgroups)


async def test_cleanup_on_error_and_cancellation(backend: LocalBackend) -> None:
    with pytest.raises(RuntimeError):
        async with await backend.create(FILES) as box:
            await box.start(["sleep", "60"])
            raise RuntimeError("harness crashed")
    assert not box.directory.exists() and backend.active() == 0

    box2 = await backend.create(FILES)

    async def attempt() -> None:
        async with box2:
            await box2.exec("sleep 60")

    task = asyncio.create_task(attempt())
    await until_async(lambda: bool(_pids_with_marker(box2.id)), timeout=10, what="the sandbox's command to start")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not box2.directory.exists() and backend.active() == 0


async def test_cap_waits_for_a_slot_then_times_out(tmp_path: Path) -> None:
    backend = LocalBackend(root=tmp_path / "capped", max_sandboxes=2, create_timeout_s=0.3)
    a = await backend.create(FILES)
    b = await backend.create(FILES)
    with pytest.raises(SandboxError, match="no sandbox slot free"):
        await backend.create(FILES)
    verifier = await a.fresh({"x.txt": "1"})  # a verifier copy shares its parent's slot
    assert backend.active() == 3
    await verifier.close()

    backend.create_timeout_s = 60.0  # now it waits (a close under load takes longer than the refusal's 0.3 s)
    waiting = asyncio.create_task(backend.create(FILES))
    await until_async(lambda: backend.waiting == 1, timeout=10, what="the creation to wait for a slot")
    assert not waiting.done()
    await a.close()
    c = await waiting  # got a's slot
    assert backend.waiting == 0
    assert backend.active() == 2
    await b.close()
    await c.close()
    assert backend.active() == 0 and not any((tmp_path / "capped").iterdir())


async def test_clear_errors(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SandboxError, match="cannot create the sandbox root"):
        LocalBackend(root=blocker / "sub")
    backend = LocalBackend(root=tmp_path / "ok")
    with pytest.raises(SandboxError, match="outside the sandbox"):
        await backend.create({"../escape.py": "x"})
    assert backend.active() == 0 and not any((tmp_path / "ok").iterdir())
    async with await backend.create(FILES) as box:
        with pytest.raises(SandboxError, match="cannot start '/nonexistent/program'"):
            await box.start(["/nonexistent/program"])


OWNER = textwrap.dedent(
    """
    import asyncio, json, sys
    from lightning_sdk.sandbox import LocalBackend
    async def main():
        backend = LocalBackend(root=sys.argv[1])
        box = await backend.create({"a.txt": "x"})
        proc = await box.start(["sleep", "300"])
        print(json.dumps({"dir": str(box.directory), "pid": proc.pid, "cgroups": box.cgroups}), flush=True)
        await asyncio.sleep(300)
    asyncio.run(main())
    """
)


def test_sigkilled_owner_leftovers_are_reaped_at_the_next_start(tmp_path: Path) -> None:
    root = tmp_path / "boxes"
    owner = subprocess.Popen([PY, "-c", OWNER, str(root)], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    info = json.loads(owner.stdout.readline())
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    assert _alive(info["pid"]) and Path(info["dir"]).exists()  # nobody cleaned up after the SIGKILL
    backend = LocalBackend(root=root)  # the next start
    assert backend.reaped == 1
    assert _wait_dead(info["pid"])
    assert not Path(info["dir"]).exists()
    assert all(not Path(cg).exists() for cg in info["cgroups"])
    assert reap_leftovers(root) == 0


def test_removals_and_creations_cut_short_are_reaped_at_the_next_start_whatever_their_age(tmp_path: Path) -> None:
    """A run killed while removing a sandbox leaves a ``.dead-`` directory (removal renames first), and one killed
    between making a sandbox's directory and its first file leaves an empty one: the next start reaps both at once
    (a restart right after a kill must not leave them for ever). A young directory with content but no metadata
    (a creator that may still be writing it) waits for ``min_age_s`` as before."""
    root = tmp_path / "boxes"
    (root / ".dead-0123456789abcdef" / "repo").mkdir(parents=True)
    (root / ".dead-0123456789abcdef" / "repo" / "x.py").write_text("x = 1\n")
    (root / "fedcba9876543210").mkdir()
    (root / "aaaabbbbccccdddd" / "tmp").mkdir(parents=True)
    backend = LocalBackend(root=root)
    assert backend.reaped == 2
    assert sorted(p.name for p in root.iterdir()) == ["aaaabbbbccccdddd"]


def test_a_creation_cut_short_moments_before_the_start_is_reaped_once_old_enough(tmp_path: Path) -> None:
    """A run SIGKILLed while it was creating a sandbox (its directory made, its metadata not yet written) and
    restarted at once: at the start the directory is too young to judge (its creator might still be writing it), so
    the backend comes back for it once it is ``reap_min_age_s`` old instead of keeping it for the run's whole life
    (CI on 2026-12-07: tests/examples/test_coding_kill.py waited 240 s for such a directory). A live sandbox under
    the same root is left alone."""
    root = tmp_path / "boxes"
    LocalBackend(root=tmp_path / "warm")  # the user-isolation probe, once, so the next start is quick
    live = LocalBackend(root=root)
    box = asyncio.run(live.create(FILES))
    cut = root / "0123456789abcdef"
    (cut / "tmp").mkdir(parents=True)
    (cut / "sandbox.json.tmp").write_text("")  # killed between opening its metadata and writing it
    backend = LocalBackend(root=root, reap_min_age_s=3.0)
    assert backend.reaped == 0 and cut.exists()  # too young at the start
    until(lambda: not cut.exists(), timeout=30, what="the half-created sandbox to be reaped", every=0.05)
    assert backend.reaped == 1
    assert box.directory.exists() and sorted(p.name for p in root.iterdir() if p.name != ".uids") == [box.id]
    asyncio.run(box.close())


async def test_closing_leaves_no_directory_and_no_metadata_is_ever_partial(backend: LocalBackend) -> None:
    box = await backend.create(FILES)
    meta = json.loads((box.directory / "sandbox.json").read_text())
    assert meta["owner_pid"] == os.getpid() and not (box.directory / "sandbox.json.tmp").exists()
    await box.close()
    assert list(backend.root.iterdir()) == []


async def test_live_owners_sandboxes_are_not_reaped(backend: LocalBackend) -> None:
    async with await backend.create(FILES) as box:
        assert reap_leftovers(backend.root) == 0
        assert Path(box.path).exists()


async def test_cancelled_create_leaves_nothing(backend: LocalBackend) -> None:
    """A creation cancelled mid-way (a released attempt) waits for its thread, then removes what it made."""
    for delay in (0.0, 0.001, 0.005, 0.02):
        task = asyncio.create_task(backend.create(FILES))
        await asyncio.sleep(delay)
        task.cancel()
        try:
            box = await task
        except asyncio.CancelledError:
            continue
        await box.close()  # it finished before the cancel landed
    assert backend.active() == 0 and list(backend.root.iterdir()) == []


async def test_cancelled_close_still_removes_everything(backend: LocalBackend) -> None:
    """A close cancelled at any of its awaits (an attempt released while its sandbox closes) still kills the
    sandbox's processes and removes its directory and cgroups (a run's last sandbox was left behind that way)."""
    for delay in (0.0, 0.001, 0.005, 0.02, 0.05):
        box = await backend.create(FILES)
        proc = await box.start(["sleep", "300"])
        task = asyncio.create_task(box.close())
        await asyncio.sleep(delay)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert not box.directory.exists() and not any(Path(cg).exists() for cg in box.cgroups)
        await asyncio.wait_for(proc.wait(), 10)
        assert proc.returncode == -signal.SIGKILL
    assert backend.active() == 0 and list(backend.root.iterdir()) == []


UNCLOSED = textwrap.dedent(
    """
    import asyncio, json, sys
    from lightning_sdk.sandbox import LocalBackend
    async def main():
        box = await LocalBackend(root=sys.argv[1]).create({"a.txt": "x"})
        proc = await box.start(["sleep", "300"])
        print(json.dumps({"dir": str(box.directory), "pid": proc.pid}), flush=True)
    asyncio.run(main())  # the loop ends with the sandbox open
    """
)


def test_sandboxes_left_open_are_removed_at_interpreter_exit(tmp_path: Path) -> None:
    out = subprocess.run([PY, "-c", UNCLOSED, str(tmp_path / "boxes")], capture_output=True, text=True, timeout=60)
    info = json.loads(out.stdout.splitlines()[0])
    assert _wait_dead(info["pid"])
    assert not Path(info["dir"]).exists()
