"""A real multi-node Ray cluster on this machine, for the ``ray_cluster`` tests: a head and extra nodes, each a
``ray start ... --block`` process of its own (its raylet and workers are its descendants), on ports and a temp
directory of the cluster's own, so several clusters (or another test's Ray) can run side by side.

::

    with RayCluster(tmp) as cluster:                       # the head: ray start --head --port FREE ...
        gpu = cluster.add_node(num_cpus=2, resources={"gpu_like": 1})
        cluster.wait_for_nodes(2)
        ... ray.init(address=cluster.address) or lightning-sdk daemon --ray ADDRESS ...
        cluster.kill_node(gpu)                             # SIGKILL that node's raylet and workers
    # on exit: every process of every node is killed (only this cluster's: by process tree), the temp dir removed

``kill_node`` is what a machine failure looks like to Ray: the raylet and its workers vanish without a word.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from tests.support.servers import free_port
from tests.support.waiting import until

__all__ = ["RayCluster", "RayNode"]

RAY = str(Path(sys.executable).with_name("ray"))
#: a dead node is noticed within a few seconds instead of Ray's default ~30 s
SYSTEM_CONFIG = {"health_check_period_ms": 500, "health_check_failure_threshold": 4, "health_check_timeout_ms": 500}


def _worker_ports(taken: list[int]) -> int:
    """The first port of a 100-port worker range (within 20000-59999) holding none of ``taken`` (the node's other
    ports and the head's): Ray refuses to start a node whose worker ports overlap another component's (seen in CI:
    the object manager's free port 38787 fell in the range 38700-38799)."""
    for k in range(400):
        low = 20000 + ((taken[0] + 37 * k) % 400) * 100
        if not any(low <= p <= low + 99 for p in taken):
            return low
    raise AssertionError(f"no 100-port worker range clear of {taken}")


@dataclass
class RayNode:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def pids(self) -> set[int]:
        """The node's processes now: ``ray start`` and every descendant (raylet, workers, actors)."""
        try:
            root = psutil.Process(self.proc.pid)
            return {root.pid, *(p.pid for p in root.children(recursive=True))}
        except psutil.NoSuchProcess:
            return set()


class RayCluster:
    """See the module docstring."""

    def __init__(self, base: Path, *, head_cpus: int = 1, head_resources: dict[str, float] | None = None) -> None:
        self.temp = Path(tempfile.mkdtemp(prefix="rc", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
        self.base = base
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: list[RayNode] = []
        # a token of this cluster's own (Ray's token auth): not ~/.ray/auth_token, which other Ray runs on this
        # machine write too; every process of the cluster and every client gets it through ``env``
        self.env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN_PATH"}
        self.env.update(
            {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        )
        self._head_cpus = head_cpus
        self._head_resources = head_resources or {}

    def __enter__(self) -> RayCluster:
        try:
            self._start(
                "head",
                [
                    "--head",
                    f"--port={self.port}",
                    f"--temp-dir={self.temp}",
                    "--include-dashboard=false",
                    f"--system-config={json.dumps(SYSTEM_CONFIG)}",
                ],
                self._head_cpus,
                self._head_resources,
            )
            self.wait_for_nodes(1)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def add_node(self, *, num_cpus: int, resources: dict[str, float] | None = None, tries: int = 2) -> RayNode:
        """Start a node and wait until the cluster counts it. Under heavy load ``ray start`` may give up reaching
        its own raylet ("Failed to get node info: Deadline Exceeded"): such a start is tried again (once)."""
        want = len(self.nodes) + 1
        for attempt in range(tries):
            node = self._start(f"node{len(self.nodes)}", [f"--address={self.address}"], num_cpus, resources or {})
            try:
                self.wait_for_nodes(want)
                return node
            except AssertionError:
                if node.proc.poll() is None or attempt == tries - 1:
                    raise
                self.nodes.remove(node)
                self.kill_node(node)
        raise AssertionError("unreachable")

    def _start(self, name: str, args: list[str], num_cpus: int, resources: dict[str, float]) -> RayNode:
        ports = [free_port() for _ in range(7)]
        low = _worker_ports([*ports, self.port])
        cmd = [
            RAY, "start", "--block", "--disable-usage-stats", "--node-ip-address=127.0.0.1",
            f"--num-cpus={num_cpus}", "--num-gpus=0", f"--resources={json.dumps(resources)}",
            f"--node-manager-port={ports[0]}", f"--object-manager-port={ports[1]}",
            f"--metrics-export-port={ports[2]}", f"--dashboard-agent-listen-port={ports[3]}",
            f"--dashboard-agent-grpc-port={ports[4]}", f"--runtime-env-agent-port={ports[5]}",
            f"--min-worker-port={low}", f"--max-worker-port={low + 99}",
            "--object-store-memory=100000000", *args,
        ]  # fmt: skip
        if name == "head":
            cmd.append(f"--ray-client-server-port={ports[6]}")
        log = self.base / f"ray-{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        node = RayNode(name, proc, log)
        self.nodes.append(node)
        return node

    def alive_nodes(self) -> int:
        try:  # a client's ray.init can take a minute on a loaded machine: then it counts as not yet
            out = subprocess.run(
                [sys.executable, "-c", _COUNT_NODES, self.address], capture_output=True, text=True, timeout=90,
                env=self.env,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return 0
        found = re.search(r"^alive nodes: (\d+)$", out.stdout, re.M)  # Ray may print its own lines around it
        return int(found.group(1)) if out.returncode == 0 and found else 0

    def wait_for_nodes(self, n: int, timeout: float = 120.0) -> None:
        """Wait until ``n`` nodes are alive in the cluster (a bounded wait on Ray's own view)."""

        def alive() -> bool:
            for node in self.nodes:
                if node.proc.poll() is not None:
                    raise AssertionError(f"ray node {node.name} exited:\n{node.log.read_text()[-3000:]}")
            return self.alive_nodes() >= n

        until(alive, timeout=timeout, what=f"{n} Ray nodes alive", every=0.5)

    def kill_node(self, node: RayNode) -> set[int]:
        """SIGKILL every process of ``node`` (a machine failing); answers the pids killed."""
        pids = node.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.proc.wait(timeout=10)
        return pids

    def diagnose(self, seconds: float = 20.0) -> str:
        """Where this cluster's Ray actors are now (``py-spy dump`` of every ``ray::`` process of its nodes, when
        py-spy is installed): for a run that hangs."""
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if not Path(spy).exists():
            return "(py-spy not installed: no actor stacks)"
        out: list[str] = []
        for node in self.nodes:
            for pid in sorted(node.pids()):
                try:
                    title = " ".join(psutil.Process(pid).cmdline())[:120]
                except psutil.Error:
                    continue
                if not title.startswith("ray::") or "IDLE" in title:
                    continue
                try:
                    dump = subprocess.run(
                        [spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=seconds
                    )
                    out.append(f"=== {node.name} pid {pid} {title}\n{dump.stdout}{dump.stderr}")
                except subprocess.TimeoutExpired:
                    out.append(f"=== {node.name} pid {pid} {title}: py-spy timed out")
        return "\n".join(out)

    def save_logs(self, dest: Path, tail_bytes: int = 200_000) -> None:
        """Copy the tail of every Ray log of this cluster (all nodes share ``temp``) to ``dest`` (before ``stop``
        removes them)."""
        for log in self.temp.glob("session_*/logs/*"):
            if log.is_file() and log.suffix in (".out", ".err", ".log") and log.stat().st_size:
                dest.mkdir(parents=True, exist_ok=True)
                with log.open("rb") as f:
                    f.seek(max(0, log.stat().st_size - tail_bytes))
                    (dest / log.name).write_bytes(f.read())

    def stop(self) -> None:
        """Kill this cluster's processes only (node by node, newest first), then remove its temp dir."""
        for node in reversed(self.nodes):
            pids = node.pids()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            with contextlib.suppress(AssertionError):  # what is left after 10 s is killed below
                until(lambda pids=pids: not any(psutil.pid_exists(p) for p in pids), timeout=10, every=0.1)
            self.kill_node(node)
        shutil.rmtree(self.temp, ignore_errors=True)


_COUNT_NODES = """
import sys, ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
print("alive nodes:", sum(1 for n in ray.nodes() if n["Alive"]), flush=True)
"""
