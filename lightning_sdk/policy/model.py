"""The default policy model: a tiny Qwen3 built from a config, saved as a normal Hugging Face model directory.

No pretrained checkpoint can be downloaded here, so the embedded default is a ~3M-parameter ``Qwen3ForCausalLM``
(hidden 256, 4 layers) over the domain tokenizer of ``lightning_sdk.policy.tokenizer``, warm-started by a short
supervised phase (``lightning_sdk.policy.warm_start``). Any HF causal-LM directory can take its place.

Why Qwen3 and not Qwen2 (the same decoder plus q/k norms): for ``model_type: qwen2`` transformers' ``AutoTokenizer``
always builds ``Qwen2Tokenizer``, which replaces the saved pre-tokenizer with Qwen's word regex and so undoes the
domain tokenizer (episodes grow ~2.5x); for ``qwen3`` it honours the saved ``tokenizer.json``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from lightning_sdk.errors import ConfigError, TokenizationError
from lightning_sdk.policy.tokenizer import build_tokenizer, save_tokenizer

if TYPE_CHECKING:
    from lightning_sdk.policy.prepare import PolicyConfig
    from lightning_sdk.tokens import ChatRenderer

__all__ = ["TinyPolicyConfig", "build_policy", "load_policy", "policy_renderer"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TinyPolicyConfig:
    """Shape of the default tiny policy (a Qwen3 architecture)."""

    vocab_size: int = 480
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 688
    max_positions: int = 1024
    seed: int = 0


def build_policy(out_dir: str | Path, corpus: Iterable[str], config: TinyPolicyConfig | None = None) -> Path:
    """Train the tokenizer on ``corpus``, initialise the model from ``config`` and save both to ``out_dir``.

    ``corpus`` should be rendered episodes (chat template applied), so the BPE learns the boilerplate they share.
    """
    cfg = config or TinyPolicyConfig()
    tokenizer = build_tokenizer(corpus, vocab_size=cfg.vocab_size)
    torch.manual_seed(cfg.seed)
    qcfg = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen3ForCausalLM(qcfg)  # type: ignore[no-untyped-call]
    path = Path(out_dir)
    save_tokenizer(tokenizer, path)
    model.save_pretrained(str(path))
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("built the tiny policy: %.2fM parameters, %d tokens, saved to %s", n_params / 1e6, len(tokenizer), path)
    return path


def load_policy(model_dir: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer (float32, eval mode) from a local HF directory."""
    path = Path(model_dir)
    if not (path / "config.json").exists():
        raise ConfigError(f"{path} is not a Hugging Face model directory (no config.json)")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.chat_template is None:
        raise ConfigError(f"the tokenizer in {path} has no chat template")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    return model, tokenizer


def policy_renderer(policy: PolicyConfig, tokenizer: PreTrainedTokenizerBase) -> ChatRenderer:
    """The policy's chat template, probed and chosen (``ChatRenderer.for_policy``: ``policy.chat_template``, a path
    made absolute when the config was loaded or a built-in name, the model's own, or its family's tool format), set
    on ``tokenizer`` too: the warm start, the learner's checkpoints and the engines' copies then render with the
    template the proxy renders with."""
    from lightning_sdk.tokens import ChatRenderer

    try:
        renderer = ChatRenderer.for_policy(tokenizer, policy.chat_template, name=policy.model)
    except TokenizationError as exc:
        raise ConfigError(f"policy {policy.model!r}: {exc}") from exc
    tokenizer.chat_template = renderer.chat_template
    return renderer
