"""A real PostgreSQL server for tests and benchmarks: ``initdb`` + ``pg_ctl`` in a temporary directory.

The server refuses to run as root, so when this process is root the binaries run as the ``postgres`` user
(``runuser -u postgres --``) in a temporary directory chowned to it. It listens on 127.0.0.1 on a free port (and a
unix socket in the same directory), with ``trust`` authentication for local connections only. ``stop()`` stops it
and removes the directory.

``PostgresServer.find()`` is None where no server binary exists at all (the tests then skip with that reason).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

__all__ = ["PG_BIN_DIRS", "PostgresServer"]

PG_BIN_DIRS = tuple(Path(f"/usr/lib/postgresql/{v}/bin") for v in (17, 16, 15, 14))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    """One throwaway PostgreSQL cluster; ``url(db)`` names a database on it, ``create_db``/``drop_db`` manage them."""

    def __init__(self, bin_dir: Path, *, fsync: bool = False) -> None:
        """``fsync=False`` (tests): no fsync at all. ``fsync=True`` (benchmarks): WAL fsynced by the WAL writer but
        ``synchronous_commit=off``, the durability of ``SQLiteStore``'s default (survives a killed process, may lose
        the last commits on an OS crash)."""
        self.bin_dir = bin_dir
        self.fsync = fsync
        self.port = 0
        self.root = Path(tempfile.mkdtemp(prefix="lsdk-pg-"))
        self.data = self.root / "data"
        self._as_postgres = os.geteuid() == 0
        self._started = False

    @staticmethod
    def find() -> Path | None:
        """The directory of the first PostgreSQL server binaries found (``$LSDK_PG_BIN`` first), else None."""
        env = os.environ.get("LSDK_PG_BIN")
        for d in ((Path(env),) if env else ()) + PG_BIN_DIRS:
            if (d / "initdb").exists() and (d / "pg_ctl").exists():
                return d
        found = shutil.which("pg_ctl")
        return Path(found).parent if found and (Path(found).parent / "initdb").exists() else None

    def _run(self, *args: str, timeout: float = 120) -> str:
        cmd = [str(self.bin_dir / args[0]), *args[1:]]
        if self._as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=self.root)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args[:2])} failed ({done.returncode}): {done.stderr[-2000:]}")
        return done.stdout

    def start(self) -> PostgresServer:
        if self._as_postgres:
            pw = pwd.getpwnam("postgres")
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        self.root.chmod(0o755)
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync")
        options = [
            "-c listen_addresses=127.0.0.1",
            f"-c unix_socket_directories={self.root}",
            "-c max_connections=400",
            "-c shared_buffers=128MB",
            f"-c fsync={'on' if self.fsync else 'off'}",
            "-c synchronous_commit=off",
            "-c full_page_writes=off" if not self.fsync else "-c full_page_writes=on",
        ]
        for _ in range(5):  # a free port can be taken between the probe and the bind: try another
            self.port = _free_port()
            try:
                self._run(
                    "pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-w", "-t", "60",
                    "-o", " ".join([f"-p {self.port}", *options]), "start",
                )  # fmt: skip
                self._started = True
                return self
            except RuntimeError:
                continue
        log_file = self.root / "server.log"
        log = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else ""
        self.stop()
        raise RuntimeError(f"PostgreSQL did not start: {log}")

    def url(self, db: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{db}"

    def sql(self, statement: str, db: str = "postgres") -> None:
        """Run one statement outside a transaction (CREATE/DROP DATABASE)."""
        import psycopg

        with psycopg.connect(self.url(db), autocommit=True) as conn:
            conn.execute(statement)  # type: ignore[arg-type]

    def create_db(self, name: str) -> str:
        self.sql(f'CREATE DATABASE "{name}" TEMPLATE template0 STRATEGY FILE_COPY')  # ~0.1 s, WAL_LOG ~0.6 s
        return self.url(name)

    def drop_db(self, name: str) -> None:
        self.sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def stop(self) -> None:
        if self._started:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop", timeout=60)
            self._started = False
        shutil.rmtree(self.root, ignore_errors=True)
