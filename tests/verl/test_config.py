"""Our flat ``VerlConfig`` resolved onto verl's own config (verl's defaults, our keys, pass-through overrides), and
accepted by verl's typed config classes (what its workers build from it)."""

from __future__ import annotations

from pathlib import Path

import pytest
from verl.utils.config import omega_conf_to_dataclass

from lightning_sdk.errors import ConfigError
from lightning_sdk.trainer.verl.config import VerlConfig, to_verl_config


def test_mapping_defaults_and_overrides(tiny_model_dir: Path) -> None:
    cfg = to_verl_config(
        VerlConfig(
            model_dir=str(tiny_model_dir),
            lr=3e-6,
            clip_ratio_high=0.3,
            kl_coef=0.01,
            micro_batch_tokens=4096,
            overrides={
                "actor_rollout_ref.actor.ppo_epochs": 2,
                "actor_rollout_ref.actor.optim.lr": 5e-6,
                "trainer.project_name": "mine",
            },
        )
    )
    a = cfg.actor_rollout_ref.actor
    assert a.optim.lr == 5e-6  # an override beats our mapping
    assert a.ppo_epochs == 2 and cfg.trainer.project_name == "mine"
    assert a.clip_ratio_high == 0.3 and a.use_kl_loss is True and a.kl_loss_coef == 0.01
    assert a.use_dynamic_bsz is True and a.ppo_max_token_len_per_gpu == 4096
    assert cfg.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu == 4096
    assert a.fsdp_config.mixed_precision.param_dtype == "bf16"  # GPU default
    assert cfg.algorithm.rollout_correction.rollout_is == "token"
    assert cfg.algorithm.rollout_correction.rollout_is_threshold == 2.0
    assert cfg.actor_rollout_ref.model.path == str(tiny_model_dir)
    assert a.policy_loss.clip_cov_ratio == 0.0002  # untouched verl default survives
    actor = omega_conf_to_dataclass(a)
    assert type(actor).__name__ == "FSDPActorConfig" and actor.optim.lr == 5e-6 and actor.clip_ratio_high == 0.3


def test_bypass_mode_sets_verls_bypass_loss(tiny_model_dir: Path) -> None:
    cfg = to_verl_config(VerlConfig(model_dir=str(tiny_model_dir), device="cpu", rollout_correction="bypass"))
    assert cfg.algorithm.rollout_correction.bypass_mode is True
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert actor.policy_loss.loss_mode == "bypass_mode"
    assert actor.policy_loss.rollout_correction["rollout_is"] == "token"  # read with .get() by the bypass loss
    assert cfg.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype == "fp32"  # CPU default


def test_bad_configs(tmp_path: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="not a directory"):
        to_verl_config(VerlConfig(model_dir=str(tmp_path / "nope")))
    with pytest.raises(ConfigError, match="needs a GPU"):
        to_verl_config(VerlConfig(model_dir=str(tiny_model_dir), device="cpu", strategy="fsdp"))
    with pytest.raises(ValueError, match="rollout_correction"):
        VerlConfig(model_dir=str(tiny_model_dir), rollout_correction="sometimes")  # type: ignore[arg-type]


def test_lora_maps_onto_verls_own_model_keys(tiny_model_dir: Path) -> None:
    """``[verl] lora = {rank, alpha, target_modules}`` sets verl's ``actor_rollout_ref.model.lora_rank`` /
    ``lora_alpha`` / ``target_modules`` (the model config the actor and the rollout share), and verl's typed model
    config accepts them; what verl cannot express is refused."""
    from lightning_sdk.trainer.learner import LoraSettings

    lora = LoraSettings(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    cfg = to_verl_config(VerlConfig(model_dir=str(tiny_model_dir), device="cpu", lora=lora))
    model = cfg.actor_rollout_ref.model
    assert model.lora_rank == 4 and model.lora_alpha == 8 and list(model.target_modules) == ["q_proj", "v_proj"]
    typed = omega_conf_to_dataclass(model)
    assert typed.lora_rank == 4 and list(typed.target_modules) == ["q_proj", "v_proj"]
    plain = to_verl_config(VerlConfig(model_dir=str(tiny_model_dir), device="cpu"))
    assert plain.actor_rollout_ref.model.lora_rank == 0  # verl's default: no LoRA
    with pytest.raises(ConfigError, match="dropout"):
        to_verl_config(VerlConfig(model_dir=str(tiny_model_dir), lora=LoraSettings(dropout=0.1)))
    with pytest.raises(ConfigError, match="whole number"):
        to_verl_config(VerlConfig(model_dir=str(tiny_model_dir), lora=LoraSettings(alpha=2.5)))
