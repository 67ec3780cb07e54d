"""The local-process sandbox backend: a directory per sandbox, processes in their own process groups under
``setrlimit`` limits, cgroup v1 ``pids``/``memory`` controllers where writable, ``unshare -n`` for commands where
permitted, and reaping of what a killed owner left behind (see the package docstring for what is enforced).

Isolation (``describe_enforcement()["isolation"]``): ``per-sandbox-user`` (as root, where the kernel permits PID and
mount namespaces: the default, and required unless a weaker one is accepted) runs every program of a sandbox under a
uid/gid of its own, allocated from ``uid_range``, in new PID, mount, IPC and UTS namespaces, chrooted into a view of
the machine that holds only the system directories and Python (read-only), the command's own program files
(read-only), its workspace, a private ``/tmp`` and home; ``shared-user`` (accepted with ``isolation="shared-user"``
or ``LIGHTNING_SDK_SANDBOX_ISOLATION=shared-user``) runs them as the trainer's user, limits only."""

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
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_sdk.sandbox._base import ExecResult, Sandbox, SandboxError, SandboxLimits

__all__ = [
    "ISOLATIONS",
    "ISOLATION_SHARED",
    "ISOLATION_USER",
    "LocalBackend",
    "LocalSandbox",
    "describe_enforcement",
    "reap_leftovers",
]

logger = logging.getLogger(__name__)

MARKER = "LIGHTNING_SANDBOX_ID"
_META = "sandbox.json"
_DOOMED = ".dead-"  # a sandbox directory being removed is first renamed to this prefix + its id
_PGIDS = "pgids"
_REPO = "repo"
_CGROUP_V1 = Path("/sys/fs/cgroup")
_VIEW = "view"  # the sandbox's root directory in per-sandbox-user isolation (mount points only, root-owned)
_STATUS = "status"  # wait statuses written by the namespace's init (the exit code of a program killed by a signal)
_UIDS = ".uids"  # under the root: one file per uid in use, holding the id of the sandbox that holds it

ISOLATION_USER = "per-sandbox-user"
ISOLATION_SHARED = "shared-user"
ISOLATIONS = (ISOLATION_USER, ISOLATION_SHARED)
ISOLATION_ENV = "LIGHTNING_SDK_SANDBOX_ISOLATION"
DEFAULT_UID_RANGE = (1_800_000_000, 65_536)  # (first uid, how many): far above real users and subuid ranges
_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_DEVICES = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8), "urandom": (1, 9)}
_NAMESPACES = ["unshare", "--pid", "--fork", "--kill-child", "--mount", "--ipc", "--uts", "--propagation", "private"]
# pid 1 of a sandbox's PID namespace: runs the program as its child (fd 9, the status file, closed on its exec),
# reaps orphans, forwards TERM/INT/HUP, and writes the program's wait status to fd 9 (the kernel never lets an
# init die of a signal, so its exit code could not say "killed by SIGKILL"); exits with the program's code
# (128 + signal when killed)
_INIT = r"""
my $child = fork();
die "fork: $!" unless defined $child;
if ($child == 0) { if (open(my $s, '>&=', 9)) { fcntl($s, 2, 1); } exec { $ARGV[0] } @ARGV; exit 127; }
for my $sig (qw(TERM INT HUP)) { $SIG{$sig} = sub { kill $sig, $child; }; }
my $status;
while ((my $pid = waitpid(-1, 0)) > 0) { if ($pid == $child) { $status = $?; last; } }
if (open(my $f, '>&=', 9)) { print $f $status; close($f); }
exit(($status & 127) ? 128 + ($status & 127) : ($status >> 8));
"""


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


def _pids_of_uid(uid: int) -> list[int]:
    """Processes running as ``uid`` (a sandbox's own uid: every one of its processes, whatever it did)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    found.append(int(entry))
    return found


def _kill_uid(uid: int | None) -> int:
    if uid is None:
        return 0
    killed = 0
    for pid in _pids_of_uid(uid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            killed += 1
    return killed


def _release_uid(root: Path, uid: int | None, sandbox_id: str) -> None:
    """Give a sandbox's uid back (once no process runs as it), if the claim is still this sandbox's."""
    if uid is None:
        return
    claim = root / _UIDS / str(uid)
    with contextlib.suppress(OSError):
        if claim.read_text() == sandbox_id:
            _kill_uid(uid)
            claim.unlink()
    with contextlib.suppress(OSError):  # the last one out removes the directory (a creator re-makes it)
        claim.parent.rmdir()


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
_USER_ISOLATION: str | None = None  # None: per-sandbox-user isolation works here; else why not
_PROBED = False
_PROBE_LOCK = threading.Lock()


def _probe_user_isolation() -> str | None:
    """None when this process can give each sandbox its own uid in its own namespaces, else the reason why not."""
    if os.getuid() != 0:
        return f"not root (uid {os.getuid()}): no other uid can be given to a sandbox"
    missing = [tool for tool in ("sh", "unshare", "mount", "setpriv", "prlimit", "perl") if shutil.which(tool) is None]
    if missing:
        return f"missing {', '.join(missing)} (util-linux, perl-base)"
    with tempfile.TemporaryDirectory() as probe:
        script = f"mount -t tmpfs probe {shlex.quote(probe)} && mount -t proc proc {shlex.quote(probe)}"
        try:
            done = subprocess.run([*_NAMESPACES, "sh", "-c", script], capture_output=True, timeout=20)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"unshare failed: {exc}"
    if done.returncode != 0:
        return f"PID/mount namespaces are not permitted here: {done.stderr.decode(errors='replace').strip()}"
    return None


def _probe() -> None:
    """Find out once per process what the OS lets us enforce."""
    global _PROBED, _UNSHARE, _LAUNCH, _USER_ISOLATION
    with _PROBE_LOCK:
        if _PROBED:
            return
        sh, prlimit = shutil.which("sh"), shutil.which("prlimit")
        _LAUNCH = (sh, prlimit) if sh and prlimit else None
        _USER_ISOLATION = _probe_user_isolation()
        for controller in ("pids", "memory"):
            _CGROUPS[controller] = _cgroup_parent(controller)
        for cmd in (["unshare", "-n"], ["unshare", "-rn"]):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                if subprocess.run([*cmd, "true"], capture_output=True, timeout=10).returncode == 0:
                    _UNSHARE = cmd
                    break
        _PROBED = True


def user_isolation_unavailable() -> str | None:
    """None when ``per-sandbox-user`` isolation works on this machine, else the reason why not."""
    _probe()
    return _USER_ISOLATION


def describe_enforcement(isolation: str | None = None) -> dict[str, str]:
    """What this machine enforces, limit by limit (for logs, the run's summary and the README). ``isolation``: the
    name of the isolation in force (``per-sandbox-user`` or ``shared-user``): given, as a backend with that
    isolation enforces it; not given, the strongest this machine provides."""
    _probe()
    root = os.getuid() == 0
    pids = _CGROUPS.get("pids")
    mem = _CGROUPS.get("memory")
    if isolation is None:
        isolation = ISOLATION_USER if _USER_ISOLATION is None else ISOLATION_SHARED
    if isolation == ISOLATION_USER:
        detail = (
            "each sandbox its own uid/gid (no supplementary groups, no_new_privs, no capabilities) in new PID, mount, "
            "IPC and UTS namespaces, chrooted into a view holding only the system directories and Python "
            "(read-only, nosuid), the command's program files (read-only), its workspace, a private /tmp and home"
        )
    else:
        detail = "the trainer's own uid, no namespaces: limits only" + (
            f" (per-sandbox-user isolation unavailable: {_USER_ISOLATION})" if _USER_ISOLATION else ""
        )
    return {
        "isolation": isolation,
        "isolation_detail": detail,
        "wall_time": "process groups killed at the timeout and at the sandbox's wall_s deadline",
        "cpu_time": "RLIMIT_CPU per process",
        "memory": "RLIMIT_AS per process" + (f" + memory cgroup {mem}" if mem else ""),
        "file_size": "RLIMIT_FSIZE per process",
        "processes": f"pids cgroup {pids} (pids.max)"
        if pids
        else (
            "RLIMIT_NPROC per sandbox uid"
            if isolation == ISOLATION_USER
            else ("RLIMIT_NPROC (not applied by the kernel to root)" if root else "RLIMIT_NPROC (per user)")
        ),
        "network": "exec() in an empty network namespace (unshare --net)"
        if isolation == ISOLATION_USER
        else (
            f"exec() in an empty network namespace ({' '.join(_UNSHARE)})"
            if _UNSHARE
            else "not enforced (unshare -n is not permitted here)"
        ),
    }


# -- reaping ---------------------------------------------------------------------------------------------------------
def _kill_everything(directory: Path, sandbox_id: str, cgroups: Sequence[str], uid: int | None = None) -> int:
    """SIGKILL every process of a sandbox: its cgroups' members, its recorded process groups, marked survivors,
    every process of its own uid."""
    killed = _kill_uid(uid)
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


def reap_leftovers(
    root: str | os.PathLike[str] | None = None,
    *,
    min_age_s: float = 10.0,
    only: Collection[str] | None = None,
    young: list[str] | None = None,
) -> int:
    """Remove sandboxes under ``root`` whose owner process is gone (killed with SIGKILL, crashed): kill their
    processes, delete their cgroups and directories. Returns how many sandboxes were reaped.

    A directory with content but no metadata yet is a creation cut short, or one still under way: it is reaped only
    once ``min_age_s`` old; the younger ones' names go into ``young`` (``LocalBackend`` comes back for them, so a
    run restarted right after a kill does not keep them for its whole life). ``only``: look at these names alone
    (and at the uid claims they hold), nothing else under ``root``."""
    base = Path(root) if root is not None else default_root()
    if not base.is_dir():
        return 0
    reaped = 0
    for directory in base.iterdir():
        if not directory.is_dir() or directory.name == _UIDS:
            continue
        if only is not None and directory.name not in only:
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
                    if young is not None:
                        young.append(directory.name)
                    continue
            except OSError:
                continue
            meta = {}
        if meta and _owner_alive(int(meta.get("owner_pid", -1)), meta.get("owner_start")):
            continue
        cgroups = list(meta.get("cgroups", []))
        uid = meta.get("uid")
        _kill_everything(directory, directory.name, cgroups, uid)
        _remove_cgroups(cgroups)
        _discard(directory)
        _release_uid(base, uid, directory.name)
        reaped += 1
        logger.info("reaped the leftover sandbox %s (owner pid %s is gone)", directory.name, meta.get("owner_pid"))
    with contextlib.suppress(OSError):  # uids whose sandbox is gone (its owner died between claim and metadata)
        for claim in (base / _UIDS).iterdir():
            with contextlib.suppress(OSError, ValueError):
                holder = claim.read_text()
                if only is not None and holder not in only:
                    continue
                fresh = time.time() - claim.stat().st_mtime < min_age_s
                if (holder or not fresh) and not (base / holder).exists():
                    _kill_uid(int(claim.name))
                    claim.unlink()
        (base / _UIDS).rmdir()
    return reaped


# -- the view (per-sandbox-user isolation) -------------------------------------------------------------------------
def _safe_makedirs(base: Path, parts: Sequence[str], *, file: bool) -> None:
    """Create ``base/parts...`` as root (mode 0755, a last file part empty, 0644), refusing any existing part that
    is a symlink or not root's: a sandbox's uid can write into its ``/tmp``, never into what root made there."""
    current = base
    for i, part in enumerate(parts):
        current = current / part
        last = i == len(parts) - 1
        try:
            info = os.lstat(current)
        except FileNotFoundError:
            try:
                if last and file:
                    os.close(os.open(current, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
                else:
                    os.mkdir(current, 0o755)
                continue
            except FileExistsError:
                info = os.lstat(current)
        if stat.S_ISLNK(info.st_mode) or info.st_uid != 0:
            raise SandboxError(f"refusing to mount over {current}: a symlink or not owned by root")


def _mount_point(box: LocalSandbox, target: str, *, is_file: bool = False) -> None:
    """Create the mount point of ``target`` (an absolute path as the sandbox sees it): inside the source of the
    deepest writable bind above it (its ``/tmp``: the default sandbox root is under ``/tmp``), else in the view."""
    where, rel = box.directory / _VIEW, Path(target).relative_to("/")
    best = -1
    for kind, source, bound in box._mounts:
        if kind == "rw" and Path(target) != Path(bound) and Path(target).is_relative_to(bound):
            depth = len(Path(bound).parts)
            if depth > best:
                best, where, rel = depth, Path(source), Path(target).relative_to(bound)
    _safe_makedirs(where, rel.parts, file=is_file)


def _view_mounts(box: LocalSandbox, readable: Sequence[str]) -> list[tuple[str, str, str]]:
    """The binds of a sandbox's view, parents first: system directories and Python (read-only), its private
    ``/tmp``, home and workspace (read-write), ``/proc`` of its PID namespace."""
    mounts: list[tuple[str, str, str]] = []
    view = box.directory / _VIEW
    for path in _SYSTEM_PATHS:
        if os.path.islink(path):  # /bin -> usr/bin: the same link in the view
            os.symlink(os.readlink(path), view / path.lstrip("/"))
        elif os.path.isdir(path):
            mounts.append(("ro", path, path))
    for path in dict.fromkeys([sys.base_prefix, sys.prefix, sys.exec_prefix, *readable]):
        path = os.path.abspath(path)
        if os.path.exists(path) and not any(Path(path).is_relative_to(t) for _, _, t in mounts):
            mounts.append(("ro", path, path))
    mounts += [
        ("rw", str(box.directory / "tmp"), "/tmp"),
        ("rw", box.home, box.home),
        ("rw", box.path, box.path),
        ("proc", "proc", "/proc"),
    ]
    return sorted(mounts, key=lambda m: len(Path(m[2]).parts))  # stable: parents first


def _build_view(box: LocalSandbox, readable: Sequence[str]) -> None:
    """The view's skeleton on disk (root-owned: mount points, links, device nodes); mounted at each start."""
    view = box.directory / _VIEW
    view.mkdir(mode=0o755)
    (view / ".old").mkdir(mode=0o700)  # where pivot_root puts the machine's root, unmounted at once
    box._mounts = _view_mounts(box, readable)
    done: list[tuple[str, str, str]] = []
    for mount in box._mounts:
        kind, source, target = mount
        box_mounts, box._mounts = box._mounts, done  # a mount point sits in the binds made before it
        try:
            _mount_point(box, target, is_file=kind == "ro" and os.path.isfile(source))
        finally:
            box._mounts = box_mounts
        done.append(mount)
    (view / "dev").mkdir(mode=0o755)
    for name, (major, minor) in _DEVICES.items():
        os.mknod(view / "dev" / name, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
        os.chmod(view / "dev" / name, 0o666)
    (view / "dev" / "shm").mkdir(mode=0o1777)
    os.chmod(view / "dev" / "shm", 0o1777)


def _fstab_line(source: str, target: str, fstype: str, options: str) -> str:
    """One fstab(5) line (spaces, tabs, newlines and backslashes octal-escaped, as libmount reads them)."""

    def esc(field: str) -> str:
        return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in field)

    return f"{esc(source)} {esc(target)} {fstype} {options} 0 0\n"


def _chown_tree(path: Path, uid: int) -> None:
    os.chown(path, uid, uid)
    for dirpath, dirnames, filenames in os.walk(path):
        for name in [*dirnames, *filenames]:
            os.chown(os.path.join(dirpath, name), uid, uid, follow_symlinks=False)


# -- the sandbox -----------------------------------------------------------------------------------------------------
class LocalSandbox(Sandbox):
    """A directory + the processes started in it (see ``LocalBackend``)."""

    def __init__(self, backend: LocalBackend, sandbox_id: str, directory: Path, limits: SandboxLimits) -> None:
        self.backend = backend
        self.id = sandbox_id
        self.directory = directory
        self.path = str(directory / _REPO)
        self.home = str(directory / "home")
        self.limits = limits
        self.uid: int | None = None  # its own uid (= its gid) in per-sandbox-user isolation
        self.cgroups: list[str] = []
        self._mounts: list[tuple[str, str, str]] = []  # (kind, source, target) of its view, parents first
        self._statuses: dict[int, Path] = {}  # launcher pid -> where the namespace's init writes the wait status
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

    @property
    def isolated(self) -> bool:
        return self.uid is not None

    def write_private(self, name: str, text: str) -> str:
        """Write a file only this sandbox's programs (and the trainer) can read, in its home; returns its path."""
        if os.sep in name or name in ("", ".", ".."):
            raise SandboxError(f"not a plain file name: {name!r}")
        path = Path(self.home, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        if self.uid is not None:
            os.chown(path, self.uid, self.uid)
        return str(path)

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
        base.pop("LIGHTNING_SDK_ADMIN_KEY", None)  # never in a sandbox, whoever passed it on
        base[MARKER] = self.id
        base["HOME"] = self.home
        base["TMPDIR"] = "/tmp" if self.isolated else str(self.directory / "tmp")
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
        if self.isolated:  # its own uid: the kernel counts exactly its processes
            out[resource.RLIMIT_NPROC] = lim.max_processes
        elif not _CGROUPS.get("pids"):
            out[resource.RLIMIT_NPROC] = _user_process_count() + lim.max_processes
        return out

    def _prlimit_args(self) -> list[str]:
        names = {
            resource.RLIMIT_AS: "--as",
            resource.RLIMIT_FSIZE: "--fsize",
            resource.RLIMIT_NOFILE: "--nofile",
            resource.RLIMIT_CORE: "--core",
            resource.RLIMIT_NPROC: "--nproc",
        }
        limits = [f"--cpu={self.limits.cpu_s}:{self.limits.cpu_s + 1}"]
        return limits + [f"{names[k]}={v}" for k, v in self._rlimits().items()]

    def _program_mounts(self, args: Sequence[str], path_env: str) -> list[tuple[str, str, str]]:
        """Read-only binds of the command's own program files (its executable, absolute file arguments) that the
        view does not already hold, their mount points created in the view."""
        covered = [Path(target) for _, _, target in self._mounts]
        wanted: list[str] = []
        first = shutil.which(args[0], path=path_env) if args else None
        for arg in [*([first] if first else []), *args]:
            if os.path.isabs(arg) and os.path.isfile(arg) and arg not in wanted:
                wanted.append(arg)
        out = []
        for file in wanted:
            if any(Path(file).is_relative_to(c) for c in covered):
                continue
            _mount_point(self, file, is_file=True)
            out.append(("ro", file, file))
        return out

    def _isolated(self, args: Sequence[str], network: bool, env: Mapping[str, str]) -> tuple[list[str], Path]:
        """The launcher of per-sandbox-user isolation: ``unshare`` (new PID, mount, IPC, UTS and, without network,
        net namespaces; its forked child is the namespace's pid 1) runs ``sh`` as root, which mounts the view, joins
        the sandbox's cgroups and execs the init; the init's child chroots into the view (``unshare --root``), drops
        to the sandbox's uid (``setpriv``: no groups, no_new_privs), applies the limits (``prlimit``), execs."""
        assert self.uid is not None
        view = str(self.directory / _VIEW)
        q = shlex.quote
        status = self.directory / _STATUS / uuid.uuid4().hex
        # one ``mount --all`` over a table of this start's mounts (one exec, not one per mount): the view onto
        # itself (pivot_root wants a mount point), then its binds, parents first
        table = [_fstab_line(view, view, "none", "bind")]
        for kind, source, target in [*self._mounts, *self._program_mounts(args, env.get("PATH", os.defpath))]:
            if kind == "proc":
                table.append(_fstab_line("proc", view + target, "proc", "nosuid,nodev,noexec"))
            else:
                opts = "bind,ro,nosuid,nodev" if kind == "ro" else "bind,nosuid,nodev"
                table.append(_fstab_line(source, view + target, "none", opts))
        fstab = status.with_suffix(".fstab")
        fstab.write_text("".join(table))
        lines = ["set -e", f"exec 9> {q(str(status))}", f"mount --all --fstab {q(str(fstab))}"]
        lines += [f"echo $$ > {q(os.path.join(cg, 'cgroup.procs'))}" for cg in self.cgroups]
        # pivot_root, not chroot: a chrooted process may not make user namespaces (``unshare -rn`` of a harness
        # that gives its own commands no network)
        lines += [f"cd {q(view)}", "pivot_root . .old", "umount -l /.old", "cd /"]
        inner = [
            "unshare",
            f"--wd={self.path}",
            "setpriv",
            f"--reuid={self.uid}",
            f"--regid={self.uid}",
            "--clear-groups",
            "--no-new-privs",
            "--inh-caps=-all",
            "prlimit",
            *self._prlimit_args(),
            "--",
        ]
        lines.append(f'exec perl -e {q(_INIT)} {" ".join(q(a) for a in inner)} "$@"')
        launcher = [*_NAMESPACES, *([] if network else ["--net"]), "--", "sh", "-c", "\n".join(lines), "sh", *args]
        return launcher, status

    def _launcher(self) -> list[str]:
        """``sh -c`` joining the sandbox's cgroups, then ``prlimit`` setting its limits, then exec of the command:
        the same process all along, started with vfork by ``subprocess`` (no ``preexec_fn``). A ``preexec_fn``
        forces a real fork of this process, which copies its page tables: ~75 ms of CPU and ~200 ms of a blocked
        event loop per start for a 1.5 GB trainer, measured here."""
        assert _LAUNCH is not None
        sh, prlimit = _LAUNCH
        limits = self._prlimit_args()
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
        self, args: Sequence[str], env: Mapping[str, str] | None, stdin: int | None, network: bool
    ) -> asyncio.subprocess.Process:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        if self._expired or time.monotonic() >= self._deadline:
            raise SandboxError(f"sandbox {self.id} ran past its wall time of {self.limits.wall_s} s")
        full_env = self._env(env)
        status: Path | None = None
        launch: dict[str, Any] = {}
        if self.isolated:
            program = args[0] if os.sep not in args[0] else os.path.join(self.path, args[0])
            if shutil.which(program, path=full_env.get("PATH", os.defpath)) is None:
                raise SandboxError(f"sandbox {self.id}: cannot start {args[0]!r}: no such executable")
            try:
                args, status = await asyncio.to_thread(self._isolated, args, network, full_env)
            except OSError as exc:
                raise SandboxError(f"sandbox {self.id}: cannot prepare its view for {args[0]!r}: {exc}") from exc
        elif _LAUNCH is None:
            launch = {"preexec_fn": self._preexec()}
            if not network and _UNSHARE:
                args = [*_UNSHARE, *args]
        else:
            if not network and _UNSHARE:
                args = [*_UNSHARE, *args]  # the launcher execs the program: say here what Popen would have said
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
        if status is not None:
            self._statuses[proc.pid] = status
        with contextlib.suppress(OSError), open(self.directory / _PGIDS, "a") as f:
            f.write(f"{proc.pid}\n")
        return proc

    def exit_code(self, proc: asyncio.subprocess.Process) -> int | None:
        """The exit code of a program started in this sandbox once it ended (negative: killed by that signal);
        in per-sandbox-user isolation read from what the namespace's init wrote (the launcher's own exit code
        says 128 + N for a program killed by signal N, as a shell does)."""
        if proc.returncode is None:
            return None
        status = self._statuses.pop(proc.pid, None)
        if status is None:
            return proc.returncode
        try:
            raw = int(status.read_text())
        except (OSError, ValueError):  # the init itself was killed (the sandbox's processes were): SIGKILL
            return proc.returncode if proc.returncode < 0 else -signal.SIGKILL
        return -(raw & 127) if raw & 127 else raw >> 8

    async def start(
        self, command: Sequence[str], *, env: Mapping[str, str] | None = None, network: bool = True
    ) -> asyncio.subprocess.Process:
        network = network or self.limits.network
        return await self._spawn(list(command), env, asyncio.subprocess.DEVNULL, network)

    async def exec(
        self,
        command: Sequence[str] | str,
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        args = ["bash", "-c", command] if isinstance(command, str) else list(command)
        remaining = self._deadline - time.monotonic()
        limit = remaining if timeout is None else min(timeout, remaining)
        proc = await self._spawn(
            args, env, asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL, self.limits.network
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
        code = self.exit_code(proc)
        code = code if code is not None else -signal.SIGKILL
        return ExecResult(
            code, out.decode(errors="replace"), err.decode(errors="replace"), timed_out or self._expired, t1 or t2
        )

    async def kill_processes(self) -> int:
        n = await asyncio.to_thread(_kill_uid, self.uid)
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
                _kill_everything(directory, self.id, cgroups, self.uid)
                _remove_cgroups(cgroups)
                _discard(directory)
            doomed = directory.with_name(_DOOMED + directory.name)
            if doomed.exists():  # a removal cancelled while its thread runs: finish it here too
                shutil.rmtree(doomed, ignore_errors=True)
            _release_uid(self.backend.root, self.uid, self.id)
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
def _uid_range(value: Sequence[int] | str | None) -> tuple[int, int]:
    """``(first, count)`` from ``None`` (the default), ``[first, count]`` or ``"first:count"``."""
    if value is None:
        return DEFAULT_UID_RANGE
    try:
        first, count = (int(v) for v in (value.split(":") if isinstance(value, str) else value))
    except (ValueError, TypeError) as exc:
        raise SandboxError(f"uid_range must be [first, count] or 'first:count', got {value!r}") from exc
    if first < 1000 or count < 1 or first + count > 2**32 - 2:
        raise SandboxError(f"uid_range {first}:{count} must lie within 1000..{2**32 - 2} (never root, never 65535)")
    return first, count


class LocalBackend:
    """Sandboxes as directories under ``root`` (default ``$TMPDIR/lightning-sandboxes``), at most ``max_sandboxes``
    at once; ``create`` waits up to ``create_timeout_s`` for a slot. Creating a backend reaps leftovers of dead
    owners under the same root, and the half-created ones too young to judge (``reap_min_age_s``) once they are old
    enough."""

    name = "local"

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        max_sandboxes: int = 32,
        create_timeout_s: float = 600.0,
        reap: bool = True,
        isolation: str | None = None,
        uid_range: Sequence[int] | str | None = None,
        readable: Sequence[str] | str = (),
        reap_min_age_s: float = 10.0,
    ) -> None:
        if int(max_sandboxes) < 1:
            raise SandboxError(f"max_sandboxes must be >= 1, got {max_sandboxes}")
        self.isolation = isolation or os.environ.get(ISOLATION_ENV) or ISOLATION_USER
        if self.isolation not in ISOLATIONS:
            raise SandboxError(f"unknown sandbox isolation {self.isolation!r}; known: {list(ISOLATIONS)}")
        self.uid_first, self.uid_count = _uid_range(uid_range)
        self.readable = [readable] if isinstance(readable, str) else [str(r) for r in readable]
        self.root = Path(root) if root is not None else default_root()
        self.max_sandboxes = int(max_sandboxes)
        self.create_timeout_s = float(create_timeout_s)
        self._lock = threading.Lock()
        self._active: dict[str, LocalSandbox] = {}
        self._uncounted: dict[str, LocalSandbox] = {}  # verifier copies (``fresh``): they share their parent's slot
        self._reserved = 0
        self.waiting = 0  # creations waiting for a slot under the cap now
        self._owner_start = _start_time(os.getpid())
        _probe()
        if self.isolation == ISOLATION_USER and _USER_ISOLATION is not None:
            raise SandboxError(
                f"sandboxes cannot run as users of their own here: {_USER_ISOLATION}. Run as root on Linux with "
                f"util-linux and perl, or accept the weaker isolation explicitly: [agent.sandbox] isolation = "
                f'"{ISOLATION_SHARED}" (or {ISOLATION_ENV}={ISOLATION_SHARED}): sandboxed programs then run as '
                "the trainer's user and can read what it can"
            )
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SandboxError(f"cannot create the sandbox root {self.root}: {exc}") from exc
        young: list[str] = []
        self.reaped = reap_leftovers(self.root, min_age_s=reap_min_age_s, young=young) if reap else 0
        if young:  # creations cut short moments ago (a restart right after a kill): reaped once old enough
            self._reap_later(young, reap_min_age_s, tries=5)
        atexit.register(self._close_all_now)

    def _reap_later(self, names: list[str], min_age_s: float, tries: int) -> None:
        """In ``min_age_s`` seconds, reap the half-created sandboxes ``names`` whose creator is gone (a daemon timer;
        again, up to ``tries`` times, for those still being written to)."""

        def run() -> None:
            still: list[str] = []
            try:
                reaped = reap_leftovers(self.root, min_age_s=min_age_s, only=set(names), young=still)
            except OSError:
                logger.exception("reaping the half-created sandboxes %s failed", names)
                return
            with self._lock:
                self.reaped += reaped
            if still and tries > 1:
                self._reap_later(still, min_age_s, tries - 1)

        timer = threading.Timer(min_age_s, run)
        timer.daemon = True
        timer.start()

    def describe(self) -> dict[str, str]:
        """``describe_enforcement`` for this backend's isolation."""
        return describe_enforcement(self.isolation)

    def _claim_uid(self, sandbox_id: str) -> int:
        """A uid of ``uid_range`` no other sandbox on this root holds (a file per uid under ``.uids``)."""
        claims = self.root / _UIDS
        start = uuid.uuid4().int % self.uid_count
        for i in range(self.uid_count):
            uid = self.uid_first + (start + i) % self.uid_count
            for _ in range(100):  # another sandbox's close may remove the directory in between
                claims.mkdir(mode=0o700, exist_ok=True)
                try:
                    fd = os.open(claims / str(uid), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    break
                except FileNotFoundError:
                    continue
                except FileExistsError:
                    fd = -1
                    break
            else:
                raise SandboxError(f"cannot claim a uid under {claims}")
            if fd < 0:
                continue
            with os.fdopen(fd, "w") as f:
                f.write(sandbox_id)
            _kill_uid(uid)  # nothing may run as it from an earlier holder
            return uid
        raise SandboxError(f"every uid of the range {self.uid_first}+{self.uid_count} is held by a sandbox")

    def _close_all_now(self) -> None:
        """At interpreter exit: kill and remove the sandboxes still open (an event loop that ended mid-attempt)."""
        with self._lock:
            boxes = [*self._active.values(), *self._uncounted.values()]
        for box in boxes:
            box._closed = True
            _kill_everything(box.directory, box.id, box.cgroups, box.uid)
            _remove_cgroups(box.cgroups)
            _discard(box.directory)
            _release_uid(self.root, box.uid, box.id)

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
        if counted and not self._try_reserve():
            self.waiting += 1
            try:
                while not self._try_reserve():
                    if time.monotonic() >= deadline:
                        raise SandboxError(
                            f"no sandbox slot free within {self.create_timeout_s} s ({self.max_sandboxes} in use)"
                        )
                    await asyncio.sleep(0.01)
            finally:
                self.waiting -= 1
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
            _release_uid(self.root, box.uid, box.id)
            raise
        with self._lock:
            self._reserved -= counted
            (self._active if counted else self._uncounted)[sandbox_id] = box
        box._arm()
        return box

    def _materialize(self, box: LocalSandbox, files: Mapping[str, str]) -> None:
        directory = box.directory
        isolated = self.isolation == ISOLATION_USER
        try:
            directory.mkdir(mode=0o700 if isolated else 0o777)
            (directory / "tmp").mkdir()
            (directory / "home").mkdir(mode=0o700)
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
            if isolated:
                box.uid = meta["uid"] = self._claim_uid(box.id)
            _write_meta(directory, meta)
            repo = directory / _REPO
            repo.mkdir()
            for rel, text in files.items():
                target = (repo / rel).resolve()
                if not target.is_relative_to(repo.resolve()):
                    raise SandboxError(f"sandbox file {rel!r} is outside the sandbox")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text, encoding="utf-8")
            if box.uid is not None:
                os.chmod(directory / "tmp", 0o1777)  # root's, sticky: the mount points root makes there stay root's
                (directory / _STATUS).mkdir(mode=0o700)
                _chown_tree(repo, box.uid)
                os.chown(directory / "home", box.uid, box.uid)
                _build_view(box, self.readable)
        except SandboxError:
            raise
        except OSError as exc:
            raise SandboxError(f"cannot create a sandbox under {self.root}: {exc}") from exc
