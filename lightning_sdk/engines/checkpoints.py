"""What a server engine (SGLang, vLLM) loads after each update: checkpoint directories written under the run.

``disk_checkpoints``: the whole model as an HF checkpoint per published version; ``adapter_checkpoints``: a LoRA
learner's adapter alone (a few MB), which vLLM loads as a new runtime adapter. Both keep the two newest versions
(the one being loaded and the one served before it).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["adapter_checkpoints", "disk_checkpoints"]


def disk_checkpoints(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    root: Path,
    *,
    current: Callable[[], dict[str, torch.Tensor]] | None = None,
) -> Callable[[dict[str, torch.Tensor] | None], str]:
    """What a server engine loads: a writer of an HF checkpoint per published version under ``root`` (the two newest
    are kept: the one being loaded and the one served before it); ``write()`` saves the model's current weights
    (``current()`` when given: a LoRA learner's merged state, under the base model's names), ``write(state)`` a
    state dict of the same model."""
    count = 0

    def write(state: dict[str, torch.Tensor] | None = None) -> str:
        """Save the model's current weights, or ``state`` (a state dict of the same model), as a checkpoint."""
        nonlocal count
        count += 1
        out = root / f"v{count:06d}"
        if state is None and current is not None:
            state = current()
        model.save_pretrained(str(out), state_dict=state)
        tokenizer.save_pretrained(str(out))
        old = root / f"v{count - 2:06d}"
        if count > 2 and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        return str(out)

    return write


def adapter_checkpoints(peft_model: Any, root: Path) -> Callable[[], str]:
    """What a vLLM engine loads when the learner trains a LoRA adapter: a writer of the PEFT adapter
    (``adapter_config.json`` + ``adapter_model.safetensors``, a few MB instead of the whole model) per published
    version under ``root``, the two newest kept. ``VLLMEngine.update_weights`` loads such a directory as a LoRA
    adapter (``is_adapter_dir``)."""
    count = 0

    def write() -> str:
        nonlocal count
        count += 1
        out = root / f"lora-v{count:06d}"
        peft_model.save_pretrained(str(out))
        old = root / f"lora-v{count - 2:06d}"
        if count > 2 and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        return str(out)

    return write
