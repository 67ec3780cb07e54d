"""The default policy's tokenizer: a compact byte-level BPE trained on the example's own text.

Why a domain tokenizer: a tiny model trains fast only when episodes are short. A character vocabulary made the calc
episodes ~940 tokens long; a few hundred BPE merges learned from rendered demonstrations bring them to ~50, while the
byte-level alphabet keeps every string encodable (nothing is ever unknown). Digits are always single tokens, so
numbers are spelled digit by digit and arithmetic stays learnable.

The result is a normal Hugging Face tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json`` with the
Qwen-style chat template of ``lightning_sdk/assets/chat_template.jinja``), loadable with ``AutoTokenizer``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from importlib import resources
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

__all__ = [
    "CONTROL_TOKENS",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "TOOL_TOKENS",
    "build_tokenizer",
    "chat_template",
    "save_tokenizer",
]

logger = logging.getLogger(__name__)

PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
CONTROL_TOKENS = [PAD_TOKEN, "<|im_start|>", EOS_TOKEN]
# Not "special": they stay in decoded text so that the Hermes parser finds them (as in Qwen's tokenizer).
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def chat_template() -> str:
    """The shipped Qwen-style chat template with tools (Hermes ``<tool_call>{json}</tool_call>``)."""
    return resources.files("lightning_sdk.assets").joinpath("chat_template.jinja").read_text(encoding="utf-8")


def build_tokenizer(corpus: Iterable[str], *, vocab_size: int = 480) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of ``vocab_size`` entries (256 bytes + merges + 7 added tokens) on ``corpus``.

    Pre-tokenization isolates every digit and otherwise keeps whole strings (no word regex), so merges may span
    spaces and punctuation: the boilerplate that every episode repeats (the tools block, the tool-call prefix)
    collapses into a handful of tokens.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = CONTROL_TOKENS + TOOL_TOKENS
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    # Control tokens are special (skipped by decode(skip_special_tokens=True)); tool tokens stay visible.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="left",
        model_max_length=4096,
    )
    fast.chat_template = chat_template()
    logger.info("built a byte-level BPE tokenizer with %d entries", len(fast))
    return fast


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template) to ``out_dir``."""
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(path))
    return path
