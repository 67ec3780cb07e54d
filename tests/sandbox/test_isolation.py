"""Per-sandbox-user isolation, with real processes on this machine (root, as CI): each sandbox runs as a uid of its
own in its own PID and mount namespaces, sees only a view of the machine, and cannot touch the trainer, the run
directory or another sandbox."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

import lightning_sdk.sandbox._local as local
from lightning_sdk.sandbox import (
    ISOLATION_SHARED,
    ISOLATION_USER,
    LocalBackend,
    SandboxError,
    SandboxLimits,
    describe_enforcement,
)

PY = sys.executable
FILES = {"pkg/__init__.py": "", "pkg/mod.py": "def f(x):\n    return x + 1\n"}

pytestmark = pytest.mark.skipif(
    local.user_isolation_unavailable() is not None, reason="per-sandbox-user isolation needs root (CI runs as root)"
)


@pytest.fixture
def backend(tmp_path: Path) -> LocalBackend:
    return LocalBackend(root=tmp_path / "boxes", max_sandboxes=4, create_timeout_s=5)


def test_the_isolation_in_force_is_named() -> None:
    info = describe_enforcement()
    assert info["isolation"] == ISOLATION_USER and "uid" in info["isolation_detail"]
    assert describe_enforcement(ISOLATION_SHARED)["isolation"] == ISOLATION_SHARED


async def test_each_sandbox_runs_as_a_uid_of_its_own_without_groups(backend: LocalBackend) -> None:
    async with await backend.create(FILES) as a, await backend.create(FILES) as b:
        ids = [await box.exec("id -u; id -g; id -G; stat -c %u .; echo $HOME; echo $TMPDIR") for box in (a, b)]
        for box, res in zip((a, b), ids, strict=True):
            uid, gid, groups, owner, home, tmp = res.stdout.split("\n")[:6]
            assert int(uid) == box.uid and int(gid) == box.uid and groups == uid and int(owner) == box.uid
            assert box.uid != os.getuid() and backend.uid_first <= box.uid < backend.uid_first + backend.uid_count
            assert home == box.home and tmp == "/tmp"
        assert a.uid != b.uid


async def test_it_sees_only_its_own_processes_and_cannot_signal_the_trainer(backend: LocalBackend) -> None:
    async with await backend.create(FILES) as box:
        script = f"ls /proc | grep -c '^[0-9]'; kill -9 {os.getpid()}; echo kill=$?; kill -9 1; echo one=$?"
        res = await box.exec(script)
        count, *rest = res.stdout.split()
        assert int(count) <= 6  # its init, bash, ls, grep (and a subshell): none of the machine's processes
        assert "kill=1" in rest and "one=1" in rest  # the trainer's pid is not in its namespace; its init is root's
        os.kill(os.getpid(), 0)  # the trainer lives (raises ProcessLookupError if not)


async def test_it_cannot_read_the_run_directory_nor_write_outside_its_workspace(
    backend: LocalBackend, tmp_path: Path
) -> None:
    store = tmp_path / "run" / "store.sqlite"
    store.parent.mkdir()
    store.write_text("every rollout and its reward")
    os.chmod(store, 0o644)  # world-readable, as a run directory's files are
    marker = Path("/tmp") / f"lightning-sandbox-escape-{os.getpid()}"
    async with await backend.create(FILES) as box:
        res = await box.exec(
            f"cat {store}; echo rc=$?; ls {tmp_path}; echo ls=$?; echo x > {marker}; "
            "echo x > /usr/escape; echo usr=$?; echo x > /etc/escape; echo etc=$?; cat /root/.bashrc; echo root=$?; "
            f"echo ok > pkg/new.txt; ls {backend.root}"
        )
        listed = res.stdout.split("ls=")[0].split("\n")[1:]
        assert "every rollout" not in res.stdout and "rc=1" in res.stdout and "run" not in listed
        assert "usr=1" in res.stdout and "etc=1" in res.stdout and "root=1" in res.stdout
        assert not marker.exists()  # its /tmp is its own
        assert Path(box.path, "pkg/new.txt").read_text() == "ok\n"
        assert res.stdout.split()[-1] == box.id  # of the sandboxes, only the way to its own
    assert not os.path.exists("/usr/escape") and not os.path.exists("/etc/escape")


async def test_it_cannot_reach_another_sandbox(backend: LocalBackend) -> None:
    async with await backend.create(FILES) as a, await backend.create({"secret.py": "HIDDEN = 1\n"}) as b:
        res = await a.exec(f"cat {b.path}/secret.py; echo rc=$?; echo x > {b.path}/planted.py; echo w=$?")
        assert "HIDDEN" not in res.stdout and "rc=1" in res.stdout and "w=1" in res.stdout
        assert not Path(b.path, "planted.py").exists()
        proc = await b.start(["sleep", "30"])
        res = await a.exec("ps -e -o pid=,comm= 2>/dev/null || ls /proc")
        assert "sleep" not in res.stdout and proc.returncode is None


async def test_exit_codes_and_signals_are_the_programs(backend: LocalBackend) -> None:
    async with await backend.create(FILES) as box:
        assert (await box.exec([PY, "-c", "raise SystemExit(3)"])).exit_code == 3
        killed = await box.exec([PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
        assert killed.exit_code == -signal.SIGKILL
        proc = await box.start([PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"])
        await proc.wait()
        assert box.exit_code(proc) == -signal.SIGTERM


async def test_a_private_file_is_readable_by_its_sandbox_only(backend: LocalBackend) -> None:
    async with await backend.create(FILES) as a, await backend.create(FILES) as b:
        path = a.write_private("task.json", '{"x": 1}')
        assert (await a.exec(["cat", path])).stdout == '{"x": 1}'
        assert (await b.exec(["cat", path])).exit_code != 0


def test_without_the_mechanism_it_refuses_unless_the_weaker_isolation_is_accepted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The machine here provides the mechanism; its absence (not root) is simulated by the probe's answer."""
    monkeypatch.setattr(local, "_USER_ISOLATION", "not root (uid 1000): no other uid can be given to a sandbox")
    monkeypatch.delenv(local.ISOLATION_ENV, raising=False)
    with pytest.raises(SandboxError, match='isolation = "shared-user"'):
        LocalBackend(root=tmp_path / "a")
    weak = LocalBackend(root=tmp_path / "b", isolation=ISOLATION_SHARED)
    assert weak.isolation == ISOLATION_SHARED and weak.describe()["isolation"] == ISOLATION_SHARED
    monkeypatch.setenv(local.ISOLATION_ENV, ISOLATION_SHARED)
    assert LocalBackend(root=tmp_path / "c").isolation == ISOLATION_SHARED
    with pytest.raises(SandboxError, match="unknown sandbox isolation"):
        LocalBackend(root=tmp_path / "d", isolation="none")


async def test_the_limits_hold_under_the_sandbox_uid(backend: LocalBackend) -> None:
    async with await backend.create(FILES, SandboxLimits(max_processes=8, file_size_mb=1, memory_mb=300)) as box:
        forks = await box.exec("for i in $(seq 1 30); do sleep 5 & done; wait", timeout=20)
        assert "fork" in forks.stderr.lower() or "resource temporarily unavailable" in forks.stderr.lower()
        big = await box.exec("head -c 5000000 /dev/zero > big.bin")
        assert big.exit_code != 0 and os.path.getsize(Path(box.path, "big.bin")) <= 1024 * 1024
        mem = await box.exec([PY, "-c", "b = bytearray(600 * 1024 * 1024)"])
        assert mem.exit_code != 0 and "MemoryError" in mem.stderr
