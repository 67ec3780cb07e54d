"""One trainer rank: verl's own ``ActorRolloutRefWorker`` (FSDP actor, optional reference) in this process.

verl's single controller normally creates these workers through ``RayWorkerGroup``, which also starts rollout
servers, checkpoint engines and a hybrid engine that we do not use (our engines are separate servers behind the
proxy). We construct the same worker class ourselves, one per rank, with the environment it expects (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and call its registered methods directly:
``init_model``, ``compute_log_prob``, ``compute_ref_log_prob``, ``update_actor``. The ``VerlRank`` class is plain
Python so it runs without Ray (``scripts/gpu_check.sh``, single-process tests); ``LocalRanks`` runs one in this
process, ``RayRanks`` one Ray actor per GPU (``backend.py`` holds one of the two).

Inputs are TensorDicts in verl's no-padding layout (``left_right_2_no_padding``), built by the driver from a
``DataProto`` (see ``batch.py``); outputs are plain tensors and floats so they cross Ray cheaply.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_sdk.errors import TrainerError

__all__ = ["LocalRanks", "RayRanks", "VerlRank", "merge_lora_tensors", "ray_module"]

logger = logging.getLogger(__name__)


def _scalar(value: Any) -> float:
    """A verl metric (a float, a tensor, a ``Metric``, or a list of those) as one float (mean)."""
    if isinstance(value, list):
        vals = [_scalar(v) for v in value]
        return sum(vals) / len(vals) if vals else 0.0
    if hasattr(value, "value") and not isinstance(value, torch.Tensor):
        return _scalar(value.value)
    if isinstance(value, torch.Tensor):
        return float(value.float().mean())
    return float(value)


def _full_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of an FSDP state dict, unsharded (``DTensor.full_tensor``: collective, the same order on every
    rank) and copied to the CPU."""
    from torch.distributed.tensor import DTensor

    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().to("cpu", copy=True) for k, v in state.items()
    }


def merge_lora_tensors(state: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """A PEFT LoRA model's state dict as the base model's, each adapted weight merged: ``W + alpha / r * B @ A``
    (PEFT's ``get_delta_weight`` for a plain ``lora.Linear``), in the weights' dtype, under the base model's names.

    verl's own merged export (``lora.merge``, ``_merged_lora_per_tensor_param``) casts every tensor to bfloat16,
    so engines would sample from a rounded copy of what the actor trains; this keeps float32 weights float32."""
    if getattr(config, "rank_pattern", None) or getattr(config, "alpha_pattern", None) or config.use_rslora:
        raise TrainerError("LoRA merge: rank_pattern, alpha_pattern and rslora are not supported")
    if getattr(config, "use_dora", False) or getattr(config, "fan_in_fan_out", False):
        raise TrainerError("LoRA merge: DoRA and fan_in_fan_out adapters are not supported")
    scale = float(config.lora_alpha) / float(config.r)

    def clean(key: str) -> str:
        key = key.removeprefix("base_model.model.")
        return key.replace(".base_layer.", ".")

    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        out[clean(key)] = value
    for key, a in state.items():
        if ".lora_A." not in key:
            continue
        prefix = key.split(".lora_A.", 1)[0]
        b = state[key.replace(".lora_A.", ".lora_B.")]
        target = clean(prefix + ".weight")
        base = out[target]
        out[target] = (base.float() + scale * (b.float() @ a.float())).to(base.dtype)
    return out


class VerlRank:
    """verl's FSDP actor (and reference, when ``use_kl_loss``) for one data-parallel rank."""

    def __init__(self, config: Any, *, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
        """``config`` is the full verl ``DictConfig`` from ``to_verl_config`` (or its YAML text, across Ray)."""
        from omegaconf import OmegaConf

        if isinstance(config, str):
            config = OmegaConf.create(config)
        self.config = config
        self.rank = rank
        self.world_size = world_size
        device = str(config.trainer.get("device", "cuda"))
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": "0",
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
        }
        self._saved_env = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        if device == "cpu":
            from lightning_sdk.trainer.verl._cpu_platform import install_cpu_platform

            install_cpu_platform()
        self._owns_process_group = not torch.distributed.is_initialized()
        if self._owns_process_group:
            backend = "gloo" if device == "cpu" else "cpu:gloo,cuda:nccl"
            torch.distributed.init_process_group(backend=backend, rank=rank, world_size=world_size)
        self.use_ref = bool(config.actor_rollout_ref.actor.use_kl_loss)
        self.ref_worker: Any = None
        try:
            from verl.workers.engine_workers import ActorRolloutRefWorker

            t0 = time.perf_counter()
            # verl's roles that include "ref" also include "rollout" (an inference engine we do not use), so the
            # frozen reference is a second worker of role "ref" in this process, sharing the process group.
            self.worker: Any = ActorRolloutRefWorker(config=config.actor_rollout_ref, role="actor")
            self.worker.init_model()
            if self.use_ref:
                self.ref_worker = ActorRolloutRefWorker(config=config.actor_rollout_ref, role="ref")
                self.ref_worker.init_model()
        except Exception as exc:
            raise TrainerError(f"verl worker rank {rank} failed to build its model: {exc}") from exc
        logger.info("verl rank %d/%d ready on %s in %.1fs", rank, world_size, device, time.perf_counter() - t0)

    # ---------------------------------------------------------------------------------------------------- compute
    def compute_log_prob(self, td: Any) -> torch.Tensor:
        """Log-probs of the responses under the current actor, padded to ``(B, R)``."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False)
        out = self.worker.compute_log_prob(td)
        return no_padding_2_padding(tu.get(out, "log_probs"), td).float().cpu()

    def compute_ref_log_prob(self, td: Any) -> torch.Tensor:
        """Log-probs under the frozen reference model, padded to ``(B, R)``."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        if not self.use_ref:
            raise TrainerError("the reference model is built only when kl_coef > 0")
        tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False)
        out = self.ref_worker.compute_ref_log_prob(td)
        return no_padding_2_padding(tu.get(out, "log_probs"), td).float().cpu()

    def update_actor(self, td: Any) -> dict[str, float]:
        """One verl actor update (``mini_batch_size`` rows per optimizer step, ``epochs`` passes)."""
        from verl.utils import tensordict_utils as tu

        out = self.worker.update_actor(td)
        metrics = tu.get(out, "metrics") if out is not None else {}
        return {k: _scalar(v) for k, v in metrics.items()}

    # ---------------------------------------------------------------------------------------------------- weights
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The actor's full (unsharded) weights on CPU, HF names. Collective: every rank must call it."""
        engine = self.worker.actor.engine
        module = engine.module
        peft_model = getattr(module, "_fsdp_wrapped_module", module)
        if hasattr(peft_model, "peft_config"):  # LoRA: the adapter merged here, in the weights' own dtype
            state = merge_lora_tensors(_full_tensors(module.state_dict()), peft_model.peft_config["default"])
            return state if self.rank == 0 else {}
        gen, _ = engine.get_per_tensor_param()
        state = {name: t.detach().to("cpu", copy=True) for name, t in gen}
        return state if self.rank == 0 else {}

    def save_hf(self, path: str) -> str:
        """Write the actor's weights as a Hugging Face checkpoint under ``path`` (rank 0 writes; collective).

        ``model.safetensors`` plus the config and tokenizer files of the original model directory: what SGLang's
        ``update_weights_from_disk``, our vLLM reload extension and the embedded engine read. A tied ``lm_head``
        is left out, as ``save_pretrained`` does.
        """
        state = self.full_state_dict()
        if self.rank == 0:
            import shutil

            from safetensors.torch import save_file

            src = Path(str(self.config.actor_rollout_ref.model.path))
            out = Path(path)
            out.mkdir(parents=True, exist_ok=True)
            hf_config = self.worker.actor.engine.model_config.hf_config
            if getattr(hf_config, "tie_word_embeddings", False):
                state.pop("lm_head.weight", None)
            save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
            for f in src.iterdir():
                if (
                    f.is_file()
                    and not f.name.endswith((".safetensors", ".bin", ".pt"))
                    and f.name != "model.safetensors.index.json"
                ):
                    shutil.copy2(f, out / f.name)
        return path

    def ping(self) -> int:
        return self.rank

    def close(self) -> None:
        """Drop the workers and, when this rank created it, the process group; restore the environment (for
        in-process use: a Ray actor just ends)."""
        self.worker = None
        self.ref_worker = None
        if self._owns_process_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def ray_module() -> Any:
    """The ``ray`` module, untyped (its stubs are partial)."""
    import ray

    return ray


def _rendezvous() -> tuple[str, int]:
    """This node's IP and a free port (run on rank 0's bundle so every rank can reach it)."""
    return str(ray_module().util.get_node_ip_address()), _free_port()


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
        ray = ray_module()
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
        ray = ray_module()
        try:
            return list(ray.get([getattr(a, method).remote(arg) for a, arg in zip(self.actors, args, strict=True)]))
        except ray.exceptions.RayError as exc:
            raise TrainerError(f"verl rank failed in {method}: {exc}") from exc

    def call_all(self, method: str, *args: Any) -> list[Any]:
        ray = ray_module()
        try:
            return list(ray.get([getattr(a, method).remote(*args) for a in self.actors]))
        except ray.exceptions.RayError as exc:
            raise TrainerError(f"verl rank failed in {method}: {exc}") from exc

    def shutdown(self) -> None:
        ray = ray_module()
        for a in self.actors if hasattr(self, "actors") else []:
            ray.kill(a)
        ray.util.remove_placement_group(self.pg)
