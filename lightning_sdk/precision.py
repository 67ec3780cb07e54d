"""The compute-dtype rule shared by the supervised warm start (``policy/warm_start.py``) and the RL learner
(``trainer/learner.py``): ``precision = "fp32" | "bf16" | "auto"`` and what ``auto`` picks on this machine.

It lives here, outside both packages, because ``lightning_sdk.trainer`` imports the warm start's config (the training
config is composed of the components' own models): the warm start importing the learner would be circular.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Literal

import torch

__all__ = ["Precision", "autocast", "cpu_has_bf16", "wants_bf16"]

Precision = Literal["fp32", "bf16", "auto"]


def cpu_has_bf16() -> bool:
    """Whether this machine's CPU computes bfloat16 natively (``avx512_bf16`` or ``amx_bf16`` in /proc/cpuinfo's
    flags, and torch's oneDNN built with bf16): where ``precision = "auto"`` picks bf16."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return False
    words = set(flags.split())
    return bool(words & {"avx512_bf16", "amx_bf16"}) and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def wants_bf16(precision: str, device: torch.device) -> bool:
    """Whether forward passes on ``device`` autocast to bfloat16 under ``precision``: always with ``bf16``; with
    ``auto`` on a CPU that computes it natively (``cpu_has_bf16``: emulated bf16 is slower than fp32)."""
    return precision == "bf16" or (precision == "auto" and device.type == "cpu" and cpu_has_bf16())


def autocast(bf16: bool, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The forward passes' autocast: bfloat16 on ``device`` when ``bf16``, else nothing (weights, gradients and the
    optimizer stay fp32 either way)."""
    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)
