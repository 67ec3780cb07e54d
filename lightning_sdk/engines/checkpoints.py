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


class _Versions:
    """Numbered version directories under ``root`` (``PREFIX000001``, ...), the newest two kept: the one being loaded
    and the one served before it."""

    def __init__(self, root: Path, prefix: str) -> None:
        self.root, self.prefix, self.count = root, prefix, 0

    def write(self, save: Callable[[Path], None]) -> str:
        """``save`` the next version's directory, remove the one two before it; the new directory's path."""
        self.count += 1
        out = self.root / f"{self.prefix}{self.count:06d}"
        save(out)
        old = self.root / f"{self.prefix}{self.count - 2:06d}"
        if self.count > 2 and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        return str(out)


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
    versions = _Versions(root, "v")

    def write(state: dict[str, torch.Tensor] | None = None) -> str:
        """Save the model's current weights, or ``state`` (a state dict of the same model), as a checkpoint."""
        if state is None and current is not None:
            state = current()

        def save(out: Path) -> None:
            model.save_pretrained(str(out), state_dict=state)
            tokenizer.save_pretrained(str(out))

        return versions.write(save)

    return write


def adapter_checkpoints(peft_model: Any, root: Path) -> Callable[[], str]:
    """What a vLLM engine loads when the learner trains a LoRA adapter: a writer of the PEFT adapter
    (``adapter_config.json`` + ``adapter_model.safetensors``, a few MB instead of the whole model) per published
    version under ``root``, the two newest kept. ``VLLMEngine.update_weights`` loads such a directory as a LoRA
    adapter (``is_adapter_dir``)."""
    versions = _Versions(root, "lora-v")

    def write() -> str:
        return versions.write(lambda out: peft_model.save_pretrained(str(out)))

    return write
