"""``launch_server``: a started server never outlives the process that started it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.waiting import until
from tests.trainer.tiny import ROOT

SCRIPT = """
import sys
from lightning_sdk.engines.launch import free_port, launch_server
port = free_port()
server = launch_server([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], port=port,
                       health_path="/", timeout=60)
print(server.process.pid, flush=True)
raise SystemExit(3)  # an error path that never calls server.stop()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:  # a zombie waiting for its parent counts as gone
        return fh.read().split(")")[-1].split()[0] != "Z"


def test_server_is_stopped_when_its_owner_exits_without_stopping_it(tmp_path: Path) -> None:
    """The server runs in its own session (so ``stop`` ends its workers), which would let it outlive an owner that
    exits on an error path; ``launch_server`` stops it at interpreter exit. A real HTTP server process."""
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 3, out.stderr
    pid = int(out.stdout.split()[0])
    until(lambda: not _alive(pid), timeout=10, what="the server to stop")


def test_openmp_wait_policy_of_the_command_is_not_passed_to_engine_servers(tmp_path: Path) -> None:
    """``lightning-sdk`` makes its own OpenMP threads wait passively (``cli.passive_openmp``) unless the user chose a
    policy; an engine server it launches gets the environment without that choice (a server tunes its own threads),
    but a policy the user set is passed on. Real server processes that report their environment."""
    script = """
import os, sys
from lightning_sdk.cli import passive_openmp
from lightning_sdk.engines.launch import free_port, launch_server
passive_openmp()
print(os.environ.get("OMP_WAIT_POLICY"), flush=True)
port = free_port()
env_file = sys.argv[1]
server = launch_server(
    [sys.executable, "-c", "import os, sys, http.server as h; open(sys.argv[2], 'w').write("
     "os.environ.get('OMP_WAIT_POLICY', '-')); h.test(h.SimpleHTTPRequestHandler, port=int(sys.argv[1]), "
     "bind='127.0.0.1')", str(port), env_file],
    port=port, health_path="/", timeout=60)
server.stop()
print(open(env_file).read(), flush=True)
"""
    for user, in_command, in_server in ((None, "PASSIVE", "-"), ("ACTIVE", "ACTIVE", "ACTIVE")):
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        env["PYTHONPATH"] = str(ROOT)
        if user is not None:
            env["OMP_WAIT_POLICY"] = user
        out = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path / "env.txt")], cwd=str(tmp_path), env=env,
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == [in_command, in_server]
