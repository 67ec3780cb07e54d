"""What this machine's CPU computes natively: where ``precision = "auto"`` (learner, warm start, embedded engine)
picks bfloat16."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["cpu_has_bf16"]


def cpu_has_bf16() -> bool:
    """Whether this machine's CPU computes bfloat16 natively (``avx512_bf16`` or ``amx_bf16`` in /proc/cpuinfo's
    flags, and torch's oneDNN built with bf16): where ``precision = "auto"`` picks bf16."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return False
    words = set(flags.split())
    return bool(words & {"avx512_bf16", "amx_bf16"}) and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
