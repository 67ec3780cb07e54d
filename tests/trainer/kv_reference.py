"""The reference for "the prefix is constant context": the whole rows' forward pass, with forward hooks that detach
the first ``prefix`` positions' keys and values in every attention layer (Qwen3: the keys after ``k_norm``, the values
out of ``v_proj``, PEFT's LoRA wrapper included). Its gradient is the whole-row gradient with the prefix's keys/values
held constant, computed without caches, without a second pass and without ``no_grad``: independent of the code it
checks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def prefix_kv_detached(model: torch.nn.Module, prefix: int) -> Iterator[None]:
    """While open, ``model``'s forward passes hold positions ``< prefix`` of every layer's keys and values constant."""

    def hook(_module: torch.nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        return torch.cat([out[:, :prefix].detach(), out[:, prefix:]], dim=1)  # [B, T, ...]: dim 1 is the position

    handles = [
        module.register_forward_hook(hook)
        for name, module in model.named_modules()
        if name.endswith(("self_attn.k_norm", "self_attn.v_proj"))
    ]
    assert handles and len(handles) % 2 == 0, "not a Qwen3-style attention (k_norm, v_proj)"
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter's gradient (zeros where none flowed), by name."""
    return {
        name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def lora_tiny(model: torch.nn.Module, seed: int = 0) -> Any:
    """``model`` with a rank-4 LoRA adapter on q/k/v/o whose B matrices are random (PEFT starts them at 0, where the
    adapter changes nothing and the prefix's keys/values would not depend on it)."""
    from lightning_sdk.trainer.learner import LoraSettings, wrap_lora

    peft_model = wrap_lora(model, LoraSettings(rank=4, alpha=8))  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return peft_model
