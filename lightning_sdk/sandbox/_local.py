"""The local-process sandbox backend: a directory per sandbox, processes in their own process groups under
``setrlimit`` limits, cgroup v1 ``pids``/``memory`` controllers where writable, ``unshare -n`` for commands where
permitted, and reaping of what a killed owner left behind (see the package docstring for what is enforced)."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
import resource
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_sdk.sandbox._base import ExecResult, Sandbox, SandboxError, SandboxLimits

__all__ = ["LocalBackend", "LocalSandbox", "describe_enforcement", "reap_leftovers"]

logger = logging.getLogger(__name__)

MARKER = "LIGHTNING_SANDBOX_ID"
_META = "sandbox.json"
_DOOMED = ".dead-"  # a sandbox directory being removed is first renamed to this prefix + its id
_PGIDS = "pgids"
_REPO = "repo"
_CGROUP_V1 = Path("/sys/fs/cgroup")


def default_root() -> Path:
    return Path(tempfile.gettempdir()) / "lightning-sandboxes"


# -- processes ------------------------------------------------------------------------------------------------------
def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (field 22 of /proc/PID/stat), to tell a live owner from a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _owner_alive(pid: int, start: str | None) -> bool:
    now = _start_time(pid)
    return now is not None and (start is None or now == start)


def _write_meta(directory: Path, meta: dict[str, Any]) -> None:
    """Write a sandbox's metadata atomically (a kill mid-write never leaves a truncated file behind)."""
    tmp = directory / (_META + ".tmp")
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, directory / _META)


def _discard(directory: Path) -> None:
    """Remove a sandbox directory, renamed out of the way first (atomic): a kill in the middle of the removal leaves
    a ``.dead-`` directory, which the next start removes whatever its age, never a half-removed sandbox whose
    metadata went first (that one would wait ``min_age_s`` to be reaped, and only at a later start)."""
    target = directory
    if not directory.name.startswith(_DOOMED):
        doomed = directory.with_name(_DOOMED + directory.name)
        try:
            os.rename(directory, doomed)
            target = doomed
        except FileNotFoundError:
            return
        except OSError:
            pass  # removed in place
    shutil.rmtree(target, ignore_errors=True)


def _kill_group(pgid: int, sig: int = signal.SIGKILL) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _pids_with_marker(sandbox_id: str) -> list[int]:
    """Processes whose environment carries this sandbox's marker (survivors that left their process group)."""
    needle = f"{MARKER}={sandbox_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            found.append(int(entry))
    return found


def _user_process_count() -> int:
    uid = os.getuid()
    n = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    n += 1
    return n


# -- cgroups (v1 controllers, where the filesystem is writable) -----------------------------------------------------
def _own_cgroup(controller: str) -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controller in controllers.split(","):
                return path.lstrip("/")
    return ""


def _cgroup_parent(controller: str) -> Path | None:
    """A writable v1 cgroup directory for ``controller`` under which sandboxes get their own cgroup, or None."""
    base = _CGROUP_V1 / controller
    if not (base / "cgroup.procs").exists():
        return None
    parent = base / _own_cgroup(controller) / "lightning-sandbox"
    try:
        parent.mkdir(exist_ok=True)
        probe = parent / f"probe-{os.getpid()}"
        probe.mkdir(exist_ok=True)
        probe.rmdir()
    except OSError:
        return None
    return parent


_CGROUPS: dict[str, Path | None] = {}
_UNSHARE: list[str] | None = None
_LAUNCH: tuple[str, str] | None = None  # (sh, prlimit): start commands without forking this (large) process
_PROBED = False
_PROBE_LOCK = threading.Lock()


def _probe() -> None:
    """Find out once per process what the OS lets us enforce."""
    global _PROBED, _UNSHARE, _LAUNCH
    with _PROBE_LOCK:
        if _PROBED:
            return
        sh, prlimit = shutil.which("sh"), shutil.which("prlimit")
        _LAUNCH = (sh, prlimit) if sh and prlimit else None
        for controller in ("pids", "memory"):
            _CGROUPS[controller] = _cgroup_parent(controller)
        for cmd in (["unshare", "-n"], ["unshare", "-rn"]):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                if subprocess.run([*cmd, "true"], capture_output=True, timeout=10).returncode == 0:
                    _UNSHARE = cmd
                    break
        _PROBED = True


def describe_enforcement() -> dict[str, str]:
    """What this machine enforces, limit by limit (for logs and the README)."""
    _probe()
    root = os.getuid() == 0
    pids = _CGROUPS.get("pids")
    mem = _CGROUPS.get("memory")
    return {
        "wall_time": "process groups killed at the timeout and at the sandbox's wall_s deadline",
        "cpu_time": "RLIMIT_CPU per process",
        "memory": "RLIMIT_AS per process" + (f" + memory cgroup {mem}" if mem else ""),
        "file_size": "RLIMIT_FSIZE per process",
        "processes": f"pids cgroup {pids} (pids.max)"
        if pids
        else ("RLIMIT_NPROC (not applied by the kernel to root)" if root else "RLIMIT_NPROC (per user)"),
        "network": f"exec() in an empty network namespace ({' '.join(_UNSHARE)})"
        if _UNSHARE
        else "not enforced (unshare -n is not permitted here)",
    }


# -- reaping ---------------------------------------------------------------------------------------------------------
def _kill_everything(directory: Path, sandbox_id: str, cgroups: Sequence[str]) -> int:
    """SIGKILL every process of a sandbox: its cgroups' members, its recorded process groups, marked survivors."""
    killed = 0
    for cg in cgroups:
        with contextlib.suppress(OSError, ValueError):
            for line in Path(cg, "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(line), signal.SIGKILL)
                    killed += 1
    with contextlib.suppress(OSError):
        for line in (directory / _PGIDS).read_text().split():
            killed += _kill_group(int(line))
    for pid in _pids_with_marker(sandbox_id):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            killed += 1
    return killed


def _remove_cgroups(cgroups: Sequence[str], wait_s: float = 2.0) -> None:
    deadline = time.monotonic() + wait_s
    for cg in cgroups:
        while True:
            try:
                os.rmdir(cg)
                break
            except FileNotFoundError:
                break
            except OSError:  # members still exiting (zombies are reaped by their parent)
                if time.monotonic() > deadline:
                    logger.warning("sandbox cgroup %s still busy; left for the next reaping", cg)
                    break
                time.sleep(0.02)


def reap_leftovers(root: str | os.PathLike[str] | None = None, *, min_age_s: float = 10.0) -> int:
    """Remove sandboxes under ``root`` whose owner process is gone (killed with SIGKILL, crashed): kill their
    processes, delete their cgroups and directories. Returns how many sandboxes were reaped."""
    base = Path(root) if root is not None else default_root()
    if not base.is_dir():
        return 0
    reaped = 0
    for directory in base.iterdir():
        if not directory.is_dir():
            continue
        if directory.name.startswith(_DOOMED):  # a removal cut short (its processes were killed before it began)
            shutil.rmtree(directory, ignore_errors=True)
            reaped += 1
            continue
        try:
            meta = json.loads((directory / _META).read_text())
        except (OSError, ValueError):
            try:  # nothing in it: a creation that had not begun; rmdir fails if a live creator has filled it since
                if not any(directory.iterdir()):
                    directory.rmdir()
                    reaped += 1
                    continue
            except OSError:
                continue
            try:  # half-created (no metadata yet): only reap when old enough that its creator gave up or died
                if time.time() - directory.stat().st_mtime < min_age_s:
                    continue
            except OSError:
                continue
            meta = {}
        if meta and _owner_alive(int(meta.get("owner_pid", -1)), meta.get("owner_start")):
            continue
        cgroups = list(meta.get("cgroups", []))
        _kill_everything(directory, directory.name, cgroups)
        _remove_cgroups(cgroups)
        _discard(directory)
        reaped += 1
        logger.info("reaped the leftover sandbox %s (owner pid %s is gone)", directory.name, meta.get("owner_pid"))
    return reaped


# -- the sandbox -----------------------------------------------------------------------------------------------------
class LocalSandbox(Sandbox):
    """A directory + the processes started in it (see ``LocalBackend``)."""

    def __init__(self, backend: LocalBackend, sandbox_id: str, directory: Path, limits: SandboxLimits) -> None:
        self.backend = backend
        self.id = sandbox_id
        self.directory = directory
        self.path = str(directory / _REPO)
        self.limits = limits
        self.cgroups: list[str] = []
        self.counted = True
        self._pgids: set[int] = set()
        self._closed = False
        self._expired = False
        self._deadline = time.monotonic() + limits.wall_s
        self._watchdog: asyncio.TimerHandle | None = None

    def __repr__(self) -> str:
        return f"<LocalSandbox {self.id} {self.path}>"

    @property
    def closed(self) -> bool:
        return self._closed

    def _arm(self) -> None:
        loop = asyncio.get_running_loop()
        self._watchdog = loop.call_later(self.limits.wall_s, self._expire)

    def _expire(self) -> None:
        self._expired = True
        for pgid in list(self._pgids):
            _kill_group(pgid)
        for cg in self.cgroups:
            with contextlib.suppress(OSError, ValueError):
                for line in Path(cg, "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(int(line), signal.SIGKILL)

    def _env(self, env: Mapping[str, str] | None) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_SDK_")}
        base.update(env or {})
        base[MARKER] = self.id
        base["HOME"] = self.path
        base["TMPDIR"] = str(self.directory / "tmp")
        base.setdefault("PYTHONDONTWRITEBYTECODE", "1")
        return base

    def _rlimits(self) -> dict[int, int]:
        """The ``setrlimit`` limits of every process of this sandbox (soft = hard, except CPU: hard one second
        above, so SIGXCPU comes before SIGKILL)."""
        lim, mb = self.limits, 1024 * 1024
        out = {
            resource.RLIMIT_AS: lim.memory_mb * mb,
            resource.RLIMIT_FSIZE: lim.file_size_mb * mb,
            resource.RLIMIT_NOFILE: lim.max_open_files,
            resource.RLIMIT_CORE: 0,
        }
        if not _CGROUPS.get("pids"):
            out[resource.RLIMIT_NPROC] = _user_process_count() + lim.max_processes
        return out

    def _launcher(self) -> list[str]:
        """``sh -c`` joining the sandbox's cgroups, then ``prlimit`` setting its limits, then exec of the command:
        the same process all along, started with vfork by ``subprocess`` (no ``preexec_fn``). A ``preexec_fn``
        forces a real fork of this process, which copies its page tables: ~75 ms of CPU and ~200 ms of a blocked
        event loop per start for a 1.5 GB trainer, measured here."""
        assert _LAUNCH is not None
        sh, prlimit = _LAUNCH
        names = {
            resource.RLIMIT_AS: "--as",
            resource.RLIMIT_FSIZE: "--fsize",
            resource.RLIMIT_NOFILE: "--nofile",
            resource.RLIMIT_CORE: "--core",
            resource.RLIMIT_NPROC: "--nproc",
        }
        limits = [f"--cpu={self.limits.cpu_s}:{self.limits.cpu_s + 1}"]
        limits += [f"{names[k]}={v}" for k, v in self._rlimits().items()]
        join = "".join(
            f"echo $$ > {shlex.quote(os.path.join(cg, 'cgroup.procs'))} || exit 125; " for cg in self.cgroups
        )
        return [sh, "-c", f'{join}exec {shlex.quote(prlimit)} {" ".join(limits)} -- "$@"', "sh"]

    def _preexec(self) -> Callable[[], None]:
        """The same as ``_launcher`` in the child between fork and exec, where ``sh``/``prlimit`` are missing."""
        cpu_s, rlimits, cgroups = self.limits.cpu_s, self._rlimits(), list(self.cgroups)

        def setup() -> None:  # runs in the child between fork and exec
            resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
            for kind, value in rlimits.items():
                resource.setrlimit(kind, (value, value))
            for cg in cgroups:
                fd = os.open(os.path.join(cg, "cgroup.procs"), os.O_WRONLY)
                try:
                    os.write(fd, str(os.getpid()).encode())
                finally:
                    os.close(fd)

        return setup

    async def _spawn(
        self, args: Sequence[str], env: Mapping[str, str] | None, stdin: int | None
    ) -> asyncio.subprocess.Process:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        if self._expired or time.monotonic() >= self._deadline:
            raise SandboxError(f"sandbox {self.id} ran past its wall time of {self.limits.wall_s} s")
        full_env = self._env(env)
        launch: dict[str, Any] = {"preexec_fn": self._preexec()} if _LAUNCH is None else {}
        if _LAUNCH is not None:  # the launcher execs the program: say here what Popen would have said
            program = args[0] if os.sep not in args[0] else os.path.join(self.path, args[0])
            if shutil.which(program, path=full_env.get("PATH", os.defpath)) is None:
                raise SandboxError(f"sandbox {self.id}: cannot start {args[0]!r}: no such executable")
            args = [*self._launcher(), *args]
        try:
            proc = await asyncio.create_subprocess_exec(
                *args,
                stdin=stdin,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=self.path,
                env=full_env,
                start_new_session=True,
                **launch,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise SandboxError(f"sandbox {self.id}: cannot start {args[0]!r}: {exc}") from exc
        self._pgids.add(proc.pid)
        with contextlib.suppress(OSError), open(self.directory / _PGIDS, "a") as f:
            f.write(f"{proc.pid}\n")
        return proc

    async def start(
        self, command: Sequence[str], *, env: Mapping[str, str] | None = None, network: bool = True
    ) -> asyncio.subprocess.Process:
        args = list(command)
        if not network and not self.limits.network and _UNSHARE:
            args = [*_UNSHARE, *args]
        return await self._spawn(args, env, asyncio.subprocess.DEVNULL)

    async def exec(
        self,
        command: Sequence[str] | str,
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        args = ["bash", "-c", command] if isinstance(command, str) else list(command)
        if not self.limits.network and _UNSHARE:
            args = [*_UNSHARE, *args]
        remaining = self._deadline - time.monotonic()
        limit = remaining if timeout is None else min(timeout, remaining)
        proc = await self._spawn(
            args, env, asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL
        )
        assert proc.stdout is not None and proc.stderr is not None
        cap = self.limits.output_bytes
        readers = [asyncio.ensure_future(_read_capped(s, cap)) for s in (proc.stdout, proc.stderr)]
        if stdin is not None and proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                proc.stdin.write(stdin)
                await proc.stdin.drain()
            proc.stdin.close()
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), max(limit, 0.001))
        except TimeoutError:
            timed_out = True
        finally:
            _kill_group(proc.pid)  # the command's leftovers (or the whole command on timeout / cancellation)
            self._pgids.discard(proc.pid)
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        (out, t1), (err, t2) = await asyncio.gather(*readers)
        code = proc.returncode if proc.returncode is not None else -signal.SIGKILL
        return ExecResult(
            code, out.decode(errors="replace"), err.decode(errors="replace"), timed_out or self._expired, t1 or t2
        )

    async def kill_processes(self) -> int:
        n = 0
        for pgid in list(self._pgids):
            n += _kill_group(pgid)
        for pid in await asyncio.to_thread(_pids_with_marker, self.id):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                n += 1
        for cg in self.cgroups:
            with contextlib.suppress(OSError, ValueError):
                for line in Path(cg, "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(int(line), signal.SIGKILL)
                        n += 1
        return n

    async def fresh(self, files: Mapping[str, str]) -> LocalSandbox:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        return await self.backend._create(files, self.limits, counted=False)

    def snapshot(self, max_bytes: int = 4_000_000) -> dict[str, str]:
        out: dict[str, str] = {}
        total = 0
        root = Path(self.path)
        for path in sorted(root.rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts or path.is_symlink():
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            total += len(text)
            if total > max_bytes:
                raise SandboxError(f"sandbox {self.id} holds more than {max_bytes} bytes of text")
            out[str(path.relative_to(root))] = text
        return out

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        cgroups, directory = list(self.cgroups), self.directory
        try:
            await self.kill_processes()
            await asyncio.to_thread(_remove_cgroups, cgroups)
            await asyncio.to_thread(_discard, directory)
        finally:
            if directory.exists():  # cancelled (or failed) half-way: finish here, or nothing would remove it
                _kill_everything(directory, self.id, cgroups)
                _remove_cgroups(cgroups)
                _discard(directory)
            self.backend._release(self)


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bool]:
    """Read to EOF, keeping the first ``cap`` bytes (the rest is drained so the writer never blocks)."""
    kept = bytearray()
    truncated = False
    while chunk := await stream.read(65536):
        room = cap - len(kept)
        if room > 0:
            kept += chunk[:room]
        if len(chunk) > max(room, 0):
            truncated = True
    return bytes(kept), truncated


# -- the backend -----------------------------------------------------------------------------------------------------
class LocalBackend:
    """Sandboxes as directories under ``root`` (default ``$TMPDIR/lightning-sandboxes``), at most ``max_sandboxes``
    at once; ``create`` waits up to ``create_timeout_s`` for a slot. Creating a backend reaps leftovers of dead
    owners under the same root."""

    name = "local"

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        max_sandboxes: int = 32,
        create_timeout_s: float = 600.0,
        reap: bool = True,
    ) -> None:
        if int(max_sandboxes) < 1:
            raise SandboxError(f"max_sandboxes must be >= 1, got {max_sandboxes}")
        self.root = Path(root) if root is not None else default_root()
        self.max_sandboxes = int(max_sandboxes)
        self.create_timeout_s = float(create_timeout_s)
        self._lock = threading.Lock()
        self._active: dict[str, LocalSandbox] = {}
        self._uncounted: dict[str, LocalSandbox] = {}  # verifier copies (``fresh``): they share their parent's slot
        self._reserved = 0
        self._owner_start = _start_time(os.getpid())
        _probe()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SandboxError(f"cannot create the sandbox root {self.root}: {exc}") from exc
        self.reaped = reap_leftovers(self.root) if reap else 0
        atexit.register(self._close_all_now)

    def _close_all_now(self) -> None:
        """At interpreter exit: kill and remove the sandboxes still open (an event loop that ended mid-attempt)."""
        with self._lock:
            boxes = [*self._active.values(), *self._uncounted.values()]
        for box in boxes:
            box._closed = True
            _kill_everything(box.directory, box.id, box.cgroups)
            _remove_cgroups(box.cgroups)
            _discard(box.directory)

    def active(self) -> int:
        """Sandboxes that exist now (verifier copies made with ``fresh`` included)."""
        with self._lock:
            return len(self._active) + len(self._uncounted)

    def _try_reserve(self) -> bool:
        with self._lock:
            if len(self._active) + self._reserved < self.max_sandboxes:
                self._reserved += 1
                return True
            return False

    def _release(self, box: LocalSandbox) -> None:
        with self._lock:
            self._active.pop(box.id, None)
            self._uncounted.pop(box.id, None)

    async def create(self, files: Mapping[str, str], limits: SandboxLimits | None = None) -> LocalSandbox:
        """A new sandbox holding ``files`` (relative path -> text); waits for a slot under the cap."""
        return await self._create(files, limits or SandboxLimits(), counted=True)

    async def _create(self, files: Mapping[str, str], lim: SandboxLimits, counted: bool) -> LocalSandbox:
        deadline = time.monotonic() + self.create_timeout_s
        while counted and not self._try_reserve():
            if time.monotonic() >= deadline:
                raise SandboxError(
                    f"no sandbox slot free within {self.create_timeout_s} s ({self.max_sandboxes} in use)"
                )
            await asyncio.sleep(0.01)
        sandbox_id = uuid.uuid4().hex[:16]
        directory = self.root / sandbox_id
        box = LocalSandbox(self, sandbox_id, directory, lim)
        box.counted = counted
        making = asyncio.ensure_future(asyncio.to_thread(self._materialize, box, files))
        try:
            await asyncio.shield(making)
        except BaseException:  # failed or cancelled: let the thread finish, then remove what it made
            with contextlib.suppress(BaseException):
                await making
            with self._lock:
                self._reserved -= counted
            _remove_cgroups(box.cgroups)
            _discard(directory)
            raise
        with self._lock:
            self._reserved -= counted
            (self._active if counted else self._uncounted)[sandbox_id] = box
        box._arm()
        return box

    def _materialize(self, box: LocalSandbox, files: Mapping[str, str]) -> None:
        directory = box.directory
        try:
            (directory / "tmp").mkdir(parents=True)
            meta: dict[str, Any] = {
                "owner_pid": os.getpid(),
                "owner_start": self._owner_start,
                "created": time.time(),
                "cgroups": [],
            }
            _write_meta(directory, meta)
            for controller, parent in _CGROUPS.items():
                if parent is None:
                    continue
                cg = parent / box.id
                cg.mkdir()
                box.cgroups.append(str(cg))
                if controller == "pids":
                    (cg / "pids.max").write_text(str(box.limits.max_processes))
                else:
                    (cg / "memory.limit_in_bytes").write_text(str(box.limits.memory_mb * 1024 * 1024))
            meta["cgroups"] = box.cgroups
            _write_meta(directory, meta)
            repo = directory / _REPO
            repo.mkdir()
            for rel, text in files.items():
                target = (repo / rel).resolve()
                if not target.is_relative_to(repo.resolve()):
                    raise SandboxError(f"sandbox file {rel!r} is outside the sandbox")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text, encoding="utf-8")
        except SandboxError:
            raise
        except OSError as exc:
            raise SandboxError(f"cannot create a sandbox under {self.root}: {exc}") from exc
