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
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from lightning_sdk.engines.base import Engine
from lightning_sdk.errors import ConfigError
from lightning_sdk.trainer.verl.batch import records_to_dataproto
from lightning_sdk.trainer.verl.config import VerlConfig, to_verl_config
from lightning_sdk.trainer.verl.step import run_step
from lightning_sdk.trainer.verl.worker import LocalRanks, RayRanks, ray_module

__all__ = ["LocalRanks", "RayRanks", "VerlBackend"]

logger = logging.getLogger(__name__)


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
        ray = ray_module()
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
    def save_weights(self) -> str:
        """Write the current weights as an HF checkpoint directory (what SGLang/vLLM reload from disk); its path."""
        out = self._publish_root / f"v{self.version:06d}"
        self.ranks.call_all("save_hf", str(out))
        return str(out)

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
            ray_module().shutdown()
