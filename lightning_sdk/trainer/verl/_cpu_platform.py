"""A CPU platform for verl, so its FSDP engine can run (slowly, with gloo) on machines without an accelerator.

verl 0.9.1 ships platforms for CUDA, NPU and ROCm only; on a CPU-only host it falls back to "nvidia" and the FSDP
engine dies in ``torch.cuda.set_device``. verl's documented extension point is ``PlatformRegistry.register`` +
``set_platform``; this module registers ``cpu`` through it. It must be installed *before* verl's engine modules are
imported, because they read ``get_device_name()`` at import time (``transformer_impl.device_name``).

Used by the CPU tests and by ``backend: verl`` with ``device: cpu``; GPU runs keep verl's own CUDA platform.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch

__all__ = ["install_cpu_platform"]

_DEVICE_MODULE: ModuleType


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


def _none(*args: Any, **kwargs: Any) -> None:
    return None


def _mem_get_info(*args: Any, **kwargs: Any) -> tuple[int, int]:
    import psutil  # type: ignore[import-untyped]

    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


def _device_module() -> ModuleType:
    """``torch.cpu`` plus the memory queries verl calls on a device module (answered as 0 / host RAM)."""
    mod = ModuleType("lightning_sdk_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(mod, name, getattr(torch.cpu, name))
    for name in ("memory_reserved", "memory_allocated", "max_memory_allocated", "max_memory_reserved"):
        setattr(mod, name, _zero)
    for name in ("empty_cache", "reset_peak_memory_stats", "ipc_collect", "set_device"):
        setattr(mod, name, _none)
    mod.mem_get_info = _mem_get_info  # type: ignore[attr-defined]
    mod.is_available = lambda: True  # type: ignore[attr-defined]
    mod.current_device = lambda: torch.device("cpu")  # type: ignore[attr-defined]
    mod.device_count = lambda: 1  # type: ignore[attr-defined]
    mod.memory_stats = lambda *a, **k: {}  # type: ignore[attr-defined]
    mod.get_device_name = lambda *a, **k: "CPU"  # type: ignore[attr-defined]
    return mod


def _platform_class() -> type[Any]:
    from verl.plugin.platform import PlatformBase

    class PlatformCPU(PlatformBase):
        """verl's platform interface answered for the host CPU (gloo collectives, no device memory)."""

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> ModuleType:
            return _DEVICE_MODULE

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return True

        def current_device(self) -> Any:
            # verl passes this to ``module.to(device=...)`` and FSDP's ``device_id``: an int would mean an
            # accelerator index, so answer the CPU device itself.
            return torch.device("cpu")

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str) -> Iterator[None]:
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
            return {}

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    return PlatformCPU


def install_cpu_platform() -> None:
    """Make verl's ``get_platform()`` answer ``cpu`` in this process and register its FSDP engines for it
    (idempotent; call before importing ``verl.workers``)."""
    from verl.plugin.platform import platform_manager

    current = platform_manager._current_platform
    if current is not None and current.device_name == "cpu":
        return
    global _DEVICE_MODULE
    _DEVICE_MODULE = _device_module()
    platform_manager.set_platform(_platform_class()())
    # verl registers its FSDP engines for cuda/npu only; the same classes serve the CPU platform.
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cpu")(FSDPEngineWithLMHead)
    EngineRegistry.register(model_type="value_model", backend=["fsdp", "fsdp2"], device="cpu")(FSDPEngineWithValueHead)
    _unpin_offload_policy()


def _unpin_offload_policy() -> None:
    """Forward-only engines (the reference model) get ``CPUOffloadPolicy(pin_memory=True)`` under FSDP2; pinned memory
    needs an accelerator and on CPU the parameters are host memory already, so keep the policy, unpinned."""
    import importlib

    transformer_impl: Any = importlib.import_module("verl.workers.engine.fsdp.transformer_impl")
    base = transformer_impl.CPUOffloadPolicy
    if base is None or getattr(base, "_lightning_unpinned", False):
        return

    class UnpinnedCPUOffloadPolicy(base):  # type: ignore[misc,valid-type]
        _lightning_unpinned = True

        def __init__(self, pin_memory: bool = True) -> None:
            super().__init__(pin_memory=False)

    transformer_impl.CPUOffloadPolicy = UnpinnedCPUOffloadPolicy
