"""``backend: verl`` — verl's FSDP workers on Ray train on our records; new weights go to the serving engines.

Launch paths (see docs/scale-out.md)::

    backend = VerlBackend(VerlConfig(model_dir=..., n_gpus=8), ray_address="auto")   # an existing cluster
    backend = VerlBackend(VerlConfig(model_dir=..., device="cpu"), ray_num_cpus=2)    # a local Ray, CPU (tests)
    metrics = backend.step(records)                    # one optimizer step; bumps backend.version
    await backend.publish(engine)                      # engine.update_weights(<hf dir>, version)

Placement: one Ray placement group with one bundle per trainer rank (``{"GPU": 1, "CPU": 1}``, or CPU only);
rank 0's node hosts the torch.distributed rendezvous. Engine servers (SGLang/vLLM) run on other GPUs of the cluster
(``lightning_sdk.engines.launch``) and agent workers reach the daemon over HTTP, so neither needs Ray.

``LocalRanks`` runs a single rank in this process without Ray (``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_sdk.engines.base import Engine
from lightning_sdk.errors import ConfigError, TrainerError
from lightning_sdk.trainer.verl.batch import records_to_dataproto
from lightning_sdk.trainer.verl.config import VerlConfig, to_verl_config
from lightning_sdk.trainer.verl.step import run_step
from lightning_sdk.trainer.verl.worker import VerlRank

__all__ = ["LocalRanks", "RayRanks", "VerlBackend"]

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _ray() -> Any:
    """The ``ray`` module, untyped (its stubs are partial)."""
    import ray

    return ray


def _rendezvous() -> tuple[str, int]:
    """This node's IP and a free port (run on rank 0's bundle so every rank can reach it)."""
    return str(_ray().util.get_node_ip_address()), _free_port()


def _worker_env() -> dict[str, str]:
    """Environment of the rank actors: our package importable even from a source checkout (not pip-installed)."""
    checkout = str(Path(__file__).resolve().parents[3])
    paths = [checkout, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), "TOKENIZERS_PARALLELISM": "false"}


class LocalRanks:
    """One ``VerlRank`` in this process (world size 1), no Ray."""

    def __init__(self, config: Any) -> None:
        self.rank = VerlRank(config, rank=0, world_size=1, master_addr="127.0.0.1", master_port=_free_port())

    @property
    def world_size(self) -> int:
        return 1

    def call(self, method: str, args: Sequence[Any]) -> list[Any]:
        return [getattr(self.rank, method)(*([args[0]] if args else []))]

    def call_all(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.rank, method)(*args)]

    def shutdown(self) -> None:
        self.rank.close()


class RayRanks:
    """``n`` ``VerlRank`` Ray actors in one placement group (one bundle each)."""

    def __init__(self, config: Any, n: int, *, use_gpu: bool) -> None:
        ray = _ray()
        from omegaconf import OmegaConf
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle: dict[str, float] = {"CPU": 1.0, "GPU": 1.0} if use_gpu else {"CPU": 1.0}
        self.pg = placement_group([dict(bundle) for _ in range(n)], strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=float(os.environ.get("LIGHTNING_SDK_RAY_PLACEMENT_TIMEOUT", "600")))
        except Exception as exc:
            ray.util.remove_placement_group(self.pg)
            raise TrainerError(
                f"Ray could not place {n} trainer rank(s) with {bundle} each: {exc}. "
                f"Cluster resources: {ray.cluster_resources()}"
            ) from exc

        def strategy(i: int) -> Any:
            return PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=i)

        addr, port = ray.get(ray.remote(_rendezvous).options(num_cpus=0, scheduling_strategy=strategy(0)).remote())
        yaml = OmegaConf.to_yaml(config, resolve=False)
        actor_cls = ray.remote(VerlRank)
        env = {"env_vars": _worker_env()}
        self.actors = [
            actor_cls.options(
                num_cpus=1, num_gpus=1 if use_gpu else 0, scheduling_strategy=strategy(i), runtime_env=env
            ).remote(yaml, rank=i, world_size=n, master_addr=addr, master_port=port)
            for i in range(n)
        ]
        try:
            ray.get([a.ping.remote() for a in self.actors])
        except Exception as exc:
            self.shutdown()
            raise TrainerError(f"verl trainer ranks failed to start: {exc}") from exc

    @property
    def world_size(self) -> int:
        return len(self.actors)

    def call(self, method: str, args: Sequence[Any]) -> list[Any]:
        ray = _ray()
        try:
            return list(ray.get([getattr(a, method).remote(arg) for a, arg in zip(self.actors, args, strict=True)]))
        except ray.exceptions.RayError as exc:
            raise TrainerError(f"verl rank failed in {method}: {exc}") from exc

    def call_all(self, method: str, *args: Any) -> list[Any]:
        ray = _ray()
        try:
            return list(ray.get([getattr(a, method).remote(*args) for a in self.actors]))
        except ray.exceptions.RayError as exc:
            raise TrainerError(f"verl rank failed in {method}: {exc}") from exc

    def shutdown(self) -> None:
        ray = _ray()
        for a in self.actors if hasattr(self, "actors") else []:
            ray.kill(a)
        ray.util.remove_placement_group(self.pg)


class VerlBackend:
    """The verl trainer: ``step(records)`` updates the policy, ``publish(engine)`` serves the new weights."""

    def __init__(
        self,
        config: VerlConfig,
        *,
        ray_address: str | None = None,
        ray_num_cpus: int | None = None,
        use_ray: bool = True,
        publish_dir: str | Path | None = None,
        pad_id: int = 0,
    ) -> None:
        """``ray_address``: ``"auto"`` or ``"ray://host:10001"`` joins a cluster; None starts a local Ray (with
        ``ray_num_cpus`` CPUs). ``use_ray=False`` runs one rank in this process (``n_gpus`` must be 1)."""
        self.config = config
        self.verl_config = to_verl_config(config)
        self.version = 0
        self.pad_id = pad_id
        self._publish_root = Path(publish_dir) if publish_dir else Path(tempfile.mkdtemp(prefix="lightning-verl-"))
        self._started_ray = False
        if not use_ray:
            if config.n_gpus != 1:
                raise ConfigError("verl backend without Ray runs one rank: set n_gpus to 1 or use Ray")
            self.ranks: LocalRanks | RayRanks = LocalRanks(self.verl_config)
            return
        ray = _ray()
        if not ray.is_initialized():
            if ray_address:
                ray.init(address=ray_address, log_to_driver=True)
            else:
                ray.init(num_cpus=ray_num_cpus, include_dashboard=False, log_to_driver=True)
                self._started_ray = True
        logger.info("Ray cluster: %s", ray.cluster_resources())
        self.ranks = RayRanks(self.verl_config, config.n_gpus, use_gpu=config.device == "cuda")

    # ------------------------------------------------------------------------------------------------- training
    def step(self, records: Iterable[Any]) -> dict[str, float]:
        """One optimizer step on ``records`` (our ``Record`` objects or exported rows); bumps ``version``."""
        t0 = time.perf_counter()
        data = records_to_dataproto(records, pad_id=self.pad_id)
        # a rollout split into several segments weighs as much as one that was not (Record.weight, as the
        # embedded learner applies it)
        weight = torch.tensor([float(w) for w in data.non_tensor_batch["weight"]], dtype=torch.float32)[:, None]
        data.batch["advantages"] = data.batch["advantages"] * weight
        data.batch["returns"] = data.batch["advantages"].clone()
        metrics = run_step(self.ranks, data, self.verl_config)
        self.version += 1
        metrics["step/seconds"] = time.perf_counter() - t0
        metrics["step/policy_version"] = float(self.version)
        logger.info("verl step %d: %d rows in %.2fs", self.version, int(metrics["step/rows"]), metrics["step/seconds"])
        return metrics

    # ------------------------------------------------------------------------------------------------- weights
    def save_weights(self) -> Path:
        """Write the current weights as an HF checkpoint directory (what SGLang/vLLM reload from disk)."""
        out = self._publish_root / f"v{self.version:06d}"
        self.ranks.call_all("save_hf", str(out))
        return out

    def state_dict(self) -> dict[str, Any]:
        """The full weights on CPU (for the embedded engine's in-memory swap)."""
        return dict(self.ranks.call_all("full_state_dict")[0])

    async def publish(self, engine: Engine, *, from_disk: bool = True) -> float:
        """Send the current weights to ``engine`` as ``version``; returns seconds taken (save + swap)."""
        t0 = time.perf_counter()
        source: Any = await asyncio.to_thread(self.save_weights if from_disk else self.state_dict)
        await engine.update_weights(str(source) if from_disk else source, self.version)
        return time.perf_counter() - t0

    def shutdown(self) -> None:
        self.ranks.shutdown()
        if self._started_ray:
            _ray().shutdown()
