"""The ``backend: verl`` config: a flat, typed model of what we name, mapped onto verl's own OmegaConf config.

verl's defaults come from verl itself (hydra ``compose("ppo_trainer")`` on the installed package's config folder),
so a verl upgrade brings its own defaults. We then set the keys we name, then apply ``overrides`` verbatim: any
dotted verl key (``{"actor_rollout_ref.actor.ppo_epochs": 2}``) passes through, and wins over our mapping.

Rollout correction (the engine's sampling policy differs from the trainer's, by numerics and by staleness):

* ``tis`` (default): the actor recomputes ``old_log_probs``; token-level importance weights
  ``min(exp(old - rollout), tis_threshold)`` (verl ``rollout_corr_helper``, ``rollout_is: token``) scale the PPO loss.
* ``bypass``: ``old_log_probs = rollout_log_probs`` (no recompute pass); verl's ``bypass_mode`` policy loss
  (PPO-clip against the rollout policy, verl ``core_algos.compute_policy_loss_bypass_mode``).
* ``none``: recompute ``old_log_probs`` and ignore the rollout log-probs (plain PPO).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from lightning_sdk.errors import ConfigError
from lightning_sdk.trainer.learner import LoraSettings

__all__ = ["VerlConfig", "to_verl_config"]

logger = logging.getLogger(__name__)


class VerlConfig(BaseModel):
    """What ``backend: verl`` reads from our config file (everything else goes in ``overrides``)."""

    model_config = ConfigDict(extra="forbid")

    model_dir: str
    device: Literal["cuda", "cpu"] = "cuda"
    n_gpus: int = Field(1, ge=1, description="trainer GPUs (FSDP data-parallel ranks); one Ray actor each")
    lr: float = 1e-6
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    policy_loss: str = "vanilla"
    kl_coef: float = 0.0
    entropy_coeff: float = 0.0
    ppo_epochs: int = 1
    mini_batches_per_step: int = 1
    micro_batch_tokens: int = Field(16384, description="tokens per micro-batch per GPU (verl dynamic batch size)")
    temperature: float = 1.0
    rollout_correction: Literal["tis", "bypass", "none"] = "tis"
    tis_threshold: float = 2.0
    strategy: Literal["fsdp", "fsdp2"] = "fsdp2"
    param_dtype: Literal["bf16", "fp16", "fp32"] | None = None  # None: bf16 on GPU, fp32 on CPU
    attn_implementation: str = "sdpa"
    gradient_checkpointing: bool = False
    lora: LoraSettings | None = Field(
        None,
        description="train a LoRA adapter (verl's actor_rollout_ref.model.lora_rank / lora_alpha / target_modules, "
        "PEFT in verl's FSDP engine); publications are the merged full weights",
    )
    overrides: dict[str, Any] = Field(default_factory=dict)


def _compose_defaults(model_dir: str) -> Any:
    import importlib.util

    from hydra import compose, initialize_config_dir

    spec = importlib.util.find_spec("verl")
    if spec is None or spec.origin is None:
        raise ConfigError("backend: verl needs verl installed: pip install 'lightning-rl-sdk[verl]'")
    config_dir = str(Path(spec.origin).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=[f"actor_rollout_ref.model.path={model_dir}"])


def _lora_keys(lora: LoraSettings) -> dict[str, Any]:
    """verl's own LoRA keys for ``[verl] lora = {rank, alpha, target_modules}``: its FSDP engine wraps the actor in
    PEFT (``verl/workers/engine/fsdp/transformer_impl.py`` ``_build_lora_module``) from ``lora_rank``,
    ``lora_alpha`` and ``target_modules`` of ``actor_rollout_ref.model`` (the model config the actor and the rollout
    share). A publication is the base with the adapter merged in float32, under the base model's names
    (``worker.merge_lora_tensors``), so engines load it as full weights; verl's own merged export (``lora.merge``)
    rounds every weight to bfloat16 and is not used."""
    if lora.dropout:
        raise ConfigError("verl backend: lora.dropout is not a key of verl's FSDP LoRA (it has none); leave it 0")
    if not float(lora.alpha).is_integer():
        raise ConfigError(f"verl backend: lora.alpha {lora.alpha} must be a whole number (verl types it int)")
    return {
        "actor_rollout_ref.model.lora_rank": lora.rank,
        "actor_rollout_ref.model.lora_alpha": int(lora.alpha),
        "actor_rollout_ref.model.target_modules": list(lora.target_modules),
    }


def to_verl_config(cfg: VerlConfig) -> Any:
    """Resolve ``cfg`` to verl's full ``DictConfig`` (defaults → our mapping → ``overrides``)."""
    from omegaconf import OmegaConf, open_dict

    set_key = OmegaConf.update  # a dotted key, made where missing (force_add)

    if not Path(cfg.model_dir).is_dir():
        raise ConfigError(f"verl backend: model_dir {cfg.model_dir!r} is not a directory (a Hugging Face checkpoint)")
    if cfg.device == "cpu" and cfg.strategy == "fsdp":
        raise ConfigError("verl backend: strategy 'fsdp' (FSDP1) needs a GPU; use 'fsdp2' on CPU")
    full = _compose_defaults(cfg.model_dir)
    param_dtype = cfg.param_dtype or ("bf16" if cfg.device == "cuda" else "fp32")
    ours: dict[str, Any] = {
        "actor_rollout_ref.model.use_remove_padding": False,
        "actor_rollout_ref.model.enable_gradient_checkpointing": cfg.gradient_checkpointing,
        "actor_rollout_ref.model.override_config": {"attn_implementation": cfg.attn_implementation},
        "actor_rollout_ref.actor.strategy": cfg.strategy,
        "actor_rollout_ref.actor.fsdp_config.strategy": cfg.strategy,
        "actor_rollout_ref.actor.fsdp_config.model_dtype": "fp32",
        "actor_rollout_ref.actor.fsdp_config.mixed_precision": {
            "param_dtype": param_dtype,
            "reduce_dtype": "fp32",
            "buffer_dtype": "fp32",
        },
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile": False,
        "actor_rollout_ref.actor.use_torch_compile": False,
        "actor_rollout_ref.actor.optim.lr": cfg.lr,
        "actor_rollout_ref.actor.optim.weight_decay": cfg.weight_decay,
        "actor_rollout_ref.actor.optim.clip_grad": cfg.grad_clip,
        "actor_rollout_ref.actor.clip_ratio_low": cfg.clip_ratio_low,
        "actor_rollout_ref.actor.clip_ratio_high": cfg.clip_ratio_high,
        "actor_rollout_ref.actor.loss_agg_mode": cfg.loss_agg_mode,
        "actor_rollout_ref.actor.policy_loss.loss_mode": cfg.policy_loss,
        "actor_rollout_ref.actor.use_kl_loss": cfg.kl_coef > 0,
        "actor_rollout_ref.actor.kl_loss_coef": cfg.kl_coef,
        "actor_rollout_ref.actor.entropy_coeff": cfg.entropy_coeff,
        "actor_rollout_ref.actor.ppo_epochs": cfg.ppo_epochs,
        # token-budget micro-batches: any number of rows of any length (no divisibility rules)
        "actor_rollout_ref.actor.use_dynamic_bsz": True,
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": cfg.micro_batch_tokens,
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": True,
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": cfg.micro_batch_tokens,
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": True,
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": cfg.micro_batch_tokens,
        "actor_rollout_ref.rollout.temperature": cfg.temperature,
        "actor_rollout_ref.ref.strategy": cfg.strategy,
        "actor_rollout_ref.ref.fsdp_config.strategy": cfg.strategy,
        "actor_rollout_ref.ref.fsdp_config.model_dtype": "fp32",
        "actor_rollout_ref.ref.fsdp_config.mixed_precision": {
            "param_dtype": param_dtype,
            "reduce_dtype": "fp32",
            "buffer_dtype": "fp32",
        },
        "algorithm.rollout_correction.rollout_is": "token" if cfg.rollout_correction != "none" else None,
        "algorithm.rollout_correction.rollout_is_threshold": cfg.tis_threshold,
        "algorithm.rollout_correction.bypass_mode": cfg.rollout_correction == "bypass",
        "trainer.n_gpus_per_node": cfg.n_gpus,
        "trainer.device": cfg.device,
        # our own keys, read by the backend (not by verl)
        "lightning.rollout_correction": cfg.rollout_correction,
        "lightning.mini_batches_per_step": cfg.mini_batches_per_step,
    }
    if cfg.lora is not None:
        ours |= _lora_keys(cfg.lora)
    if cfg.rollout_correction == "bypass":
        # what verl's rollout_corr_helper.apply_bypass_mode does to the actor's loss config before workers start
        ours["actor_rollout_ref.actor.policy_loss.loss_mode"] = "bypass_mode"
        ours["actor_rollout_ref.actor.policy_loss.rollout_correction"] = {
            "rollout_is": "token",
            "rollout_is_threshold": cfg.tis_threshold,
            "loss_type": "ppo_clip",
            "bypass_mode": True,
        }
    with open_dict(full):
        for key, value in {**ours, **cfg.overrides}.items():
            try:
                set_key(full, key, value, merge=False, force_add=True)
            except Exception as exc:  # omegaconf raises several unrelated types for bad keys
                raise ConfigError(f"verl backend: cannot set {key}={value!r}: {exc}") from exc
    logger.info("verl config resolved: %d keys set by lightning_sdk, %d overrides", len(ours), len(cfg.overrides))
    return full
