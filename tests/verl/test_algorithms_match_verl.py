"""Our advantage estimators and policy loss against verl's own (``verl.trainer.ppo.core_algos``) on the same tensors,
and verl's truncated importance weights (``rollout_corr_helper``, what ``rollout_correction: tis`` applies) against
their definition. The embedded learner and the verl backend must optimise the same objective.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

from lightning_sdk.records.advantages import AdvantageConfig, AdvantageInput, compute_advantages
from lightning_sdk.trainer.losses import LossSettings, get_policy_loss
from lightning_sdk.trainer.verl.batch import records_to_dataproto


def _batch(seed: int, n: int = 12, length: int = 7) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """Outcome rewards as verl holds them: the score on the last response token; groups of 1 to 4."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, length + 1, n)
    mask = torch.zeros(n, length)
    for i, k in enumerate(lengths):
        mask[i, :k] = 1
    scores = torch.tensor(rng.choice([0.0, 0.5, 1.0, 2.0], n), dtype=torch.float32)
    rewards = torch.zeros(n, length)
    rewards[torch.arange(n), torch.as_tensor(lengths - 1)] = scores
    groups = np.array([0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 4, 4][:n])
    return rewards, mask, groups


def _ours(name: str, rewards: torch.Tensor, mask: torch.Tensor, groups: np.ndarray, **kw: Any) -> torch.Tensor:
    items = AdvantageInput.of(rewards.sum(-1).double().numpy(), groups, mask.sum(-1).long().numpy())
    adv = compute_advantages(items, AdvantageConfig(estimator=name, **kw))
    return torch.as_tensor(adv, dtype=torch.float32)[:, None] * mask


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    ("ours", "verl_name", "ours_kw", "verl_kw"),
    [
        ("grpo", "grpo", {}, {"norm_adv_by_std_in_grpo": True}),
        ("grpo", "grpo", {"norm_by_std": False}, {"norm_adv_by_std_in_grpo": False}),
        ("dr_grpo", "grpo", {}, {"norm_adv_by_std_in_grpo": False}),
        ("rloo", "rloo", {}, {}),
        ("reinforce_plus_plus_baseline", "reinforce_plus_plus_baseline", {}, {}),
    ],
)
def test_advantages_equal_verl(
    seed: int, ours: str, verl_name: str, ours_kw: dict[str, Any], verl_kw: dict[str, Any]
) -> None:
    rewards, mask, groups = _batch(seed)
    verl_adv, _ = core_algos.get_adv_estimator_fn(verl_name)(
        token_level_rewards=rewards, response_mask=mask, index=groups, epsilon=1e-6, **verl_kw
    )
    torch.testing.assert_close(_ours(ours, rewards, mask, groups, **ours_kw), verl_adv, atol=1e-5, rtol=1e-5)


@dataclass
class _ActorCfg:
    """The fields of verl's ActorConfig that ``compute_policy_loss_vanilla`` reads."""

    clip_ratio: float = 0.2
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: float = 3.0
    global_batch_info: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_ppo_clip_loss_and_gradient_equal_verl(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(6, 9, generator=g) * 3
    new = (old + torch.randn(6, 9, generator=g) * 0.4).requires_grad_(True)
    adv = torch.randn(6, 9, generator=g)
    mask = (torch.rand(6, 9, generator=g) > 0.3).float()
    is_w = torch.rand(6, 9, generator=g) * 2

    cfg = _ActorCfg()
    verl_loss, verl_metrics = core_algos.compute_policy_loss_vanilla(
        old_log_prob=old,
        log_prob=new,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode="token-mean",
        config=cfg,
        rollout_is_weights=is_w,
    )
    (verl_grad,) = torch.autograd.grad(verl_loss, new)

    settings = LossSettings(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    per_token, metrics = get_policy_loss("ppo_clip")(old, new, adv, mask, settings)
    our_loss = (per_token * is_w * mask).sum() / mask.sum()
    (our_grad,) = torch.autograd.grad(our_loss, new)

    torch.testing.assert_close(our_loss, verl_loss)
    torch.testing.assert_close(our_grad, verl_grad)
    assert metrics["ppo_kl"] == pytest.approx(verl_metrics["actor/ppo_kl"], abs=1e-6)
    assert metrics["clip_frac"] == pytest.approx(verl_metrics["actor/pg_clipfrac"], abs=1e-6)


def test_truncated_importance_weights_are_min_ratio_threshold() -> None:
    """``tis``: w = min(pi_old / pi_rollout, 2.0) per token, detached, 0 outside the mask."""
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(4, 6, generator=g) * 2
    old = rollout + torch.randn(4, 6, generator=g)
    mask = (torch.rand(4, 6, generator=g) > 0.2).float()
    weights, new_mask, metrics = compute_rollout_correction_and_rejection_mask(
        old_log_prob=old, rollout_log_prob=rollout, response_mask=mask, rollout_is="token", rollout_is_threshold=2.0
    )
    want = torch.clamp(torch.exp(old - rollout), max=2.0) * mask
    torch.testing.assert_close(weights.batch["rollout_is_weights"] * mask, want)
    assert torch.equal(new_mask, mask)  # no rejection sampling configured
    assert "rollout_corr/rollout_is_mean" in metrics


def test_verl_loss_on_our_batch_equals_our_loss_on_our_records() -> None:
    """The verl backend's batch fed to verl's loss = our learner's loss on the same records (ratio 1, token-mean)."""
    records = [
        {
            "input_ids": [1, 2, 3, 4, 5, 6],
            "loss_mask": [0, 0, 1, 1, 0, 1],
            "logprobs": [0, 0, -1.0, -0.5, 0, -2.0],
            "advantage": 0.8,
            "reward": 1.0,
            "group": "g",
        },
        {
            "input_ids": [1, 2, 7, 8],
            "loss_mask": [0, 1, 1, 1],
            "logprobs": [0, -0.3, -0.7, -0.1],
            "advantage": [0.0, -0.4, -0.2, -0.6],
            "reward": 0.0,
            "group": "g",
        },
    ]
    data = records_to_dataproto(records)
    b = data.batch
    current = b["rollout_log_probs"] + 0.05 * b["response_mask"]  # a slightly moved policy
    verl_loss, _ = core_algos.compute_policy_loss_vanilla(
        old_log_prob=b["rollout_log_probs"],
        log_prob=current,
        advantages=b["advantages"],
        response_mask=b["response_mask"],
        loss_agg_mode="token-mean",
        config=_ActorCfg(),
    )
    # our learner's view: full sequences, loss mask over every token
    ours = 0.0
    n_tokens = 0
    settings = LossSettings(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    for rec in records:
        mask = torch.tensor(rec["loss_mask"], dtype=torch.float32)[None]
        old = torch.tensor(rec["logprobs"], dtype=torch.float32)[None]
        adv_v = rec["advantage"]
        adv = (torch.full_like(old, adv_v) if isinstance(adv_v, float) else torch.tensor([adv_v])) * mask
        per_token, _ = get_policy_loss("ppo_clip")(old, old + 0.05 * mask, adv, mask, settings)
        ours += float((per_token * mask).sum())
        n_tokens += int(mask.sum())
    assert float(verl_loss) == pytest.approx(ours / n_tokens, rel=1e-6)
