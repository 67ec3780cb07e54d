"""The default tiny policy: a domain BPE tokenizer, a Qwen-style chat template with tools, a Qwen3 built from a
config, and the warm start that teaches it the format. Any HF causal-LM directory can replace it."""

from lightning_sdk.policy.model import TinyPolicyConfig, build_policy, load_policy
from lightning_sdk.policy.tokenizer import build_tokenizer, chat_template, save_tokenizer
from lightning_sdk.policy.warm_start import (
    WarmStartConfig,
    WarmStartResult,
    render_demonstration,
    render_demonstration_rows,
    warm_start,
)

__all__ = [
    "TinyPolicyConfig",
    "WarmStartConfig",
    "WarmStartResult",
    "build_policy",
    "build_tokenizer",
    "chat_template",
    "load_policy",
    "render_demonstration",
    "render_demonstration_rows",
    "save_tokenizer",
    "warm_start",
]
