"""Policy losses, registered by name with one typed signature.

Every loss takes per-token tensors of shape [batch, tokens] and returns the per-token loss matrix (to be aggregated
by the learner over the loss mask) plus metrics. ``ppo_clip`` is the clipped surrogate of PPO (Schulman et al., 2017,
https://arxiv.org/abs/1707.06347) with the dual clip of Ye et al. (2019, https://arxiv.org/abs/1912.09729) for
negative advantages; it computes exactly what ``verl.trainer.ppo.core_algos.compute_policy_loss_vanilla`` computes
(a test compares them on the same tensors), so the embedded and verl backends share the math. GRPO is ``ppo_clip``
fed with group-normalised advantages. The clip only acts when ``logprobs`` have moved away from ``old_logprobs``,
i.e. from the second optimizer update of a step on (``LearnerConfig.ppo_epochs`` / ``mini_batches``); on the first
its gradient is the plain policy gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from lightning_sdk.errors import ConfigError

__all__ = ["LossSettings", "PolicyLoss", "get_policy_loss", "policy_loss_names", "register_policy_loss"]


@dataclass(frozen=True)
class LossSettings:
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0


class PolicyLoss(Protocol):
    def __call__(
        self,
        old_logprobs: torch.Tensor,  # [B, T] log-probs of the policy the ratio is taken against (no grad)
        logprobs: torch.Tensor,  # [B, T] current log-probs (with grad)
        advantages: torch.Tensor,  # [B, T]
        mask: torch.Tensor,  # [B, T] 1.0 where the token is trained
        settings: LossSettings,
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    def wrap(fn: PolicyLoss) -> PolicyLoss:
        _LOSSES[name] = fn
        return fn

    return wrap


def get_policy_loss(name: str) -> PolicyLoss:
    try:
        return _LOSSES[name]
    except KeyError:
        raise ConfigError(f"unknown policy loss {name!r}; valid: {', '.join(sorted(_LOSSES))}") from None


def policy_loss_names() -> list[str]:
    return sorted(_LOSSES)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((x * mask).sum() / mask.sum().clamp(min=1.0)).item())


@register_policy_loss("ppo_clip")
def ppo_clip(
    old_logprobs: torch.Tensor,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token ``max(-A r, -A clip(r, 1-eps_low, 1+eps_high))``, capped at ``-A c`` for A < 0 (dual clip)."""
    log_ratio = torch.clamp(logprobs - old_logprobs, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - settings.clip_ratio_low, 1.0 + settings.clip_ratio_high)
    surrogate = torch.maximum(unclipped, clipped)
    dual = torch.minimum(-advantages * settings.clip_ratio_c, surrogate)
    loss = torch.where(advantages < 0, dual, surrogate)
    metrics = {
        "ppo_kl": _masked_mean(-log_ratio.detach(), mask),
        "clip_frac": _masked_mean(torch.gt(clipped, unclipped).float(), mask),
    }
    return loss, metrics


@register_policy_loss("reinforce")
def reinforce(
    old_logprobs: torch.Tensor,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Plain policy gradient ``-A log pi`` (no ratio, no clip): a reference point for debugging."""
    return -advantages * logprobs, {}
