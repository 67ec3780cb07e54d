"""The checkpoint writers of server engines (``engines/checkpoints.py``): what SGLang/vLLM load after each update."""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_sdk.engines.checkpoints import disk_checkpoints
from lightning_sdk.policy.model import load_policy
from tests.trainer.tiny import build_small_policy


def test_disk_checkpoints_write_the_current_source_a_given_state_or_the_model_and_keep_two(tmp_path: Path) -> None:
    """``write()`` saves ``current()`` when a source is given (a LoRA learner's merged state), the model's own weights
    otherwise; ``write(state)`` saves ``state``; only the two newest version directories are kept."""
    model, tokenizer = load_policy(build_small_policy(tmp_path / "tiny"))
    name, base = next(iter(model.state_dict().items()))
    shifted = {k: v + 1.0 if k == name else v for k, v in model.state_dict().items()}
    calls = []

    def current() -> dict[str, torch.Tensor]:
        calls.append(1)
        return shifted

    def saved(path: str) -> torch.Tensor:
        loaded, _ = load_policy(path)
        return loaded.state_dict()[name]

    with_source = disk_checkpoints(model, tokenizer, tmp_path / "a", current=current)
    first = with_source()
    assert calls == [1] and torch.equal(saved(first), base + 1.0)
    given = {k: v - 1.0 if k == name else v for k, v in model.state_dict().items()}
    second = with_source(given)
    assert calls == [1] and torch.equal(saved(second), base - 1.0)  # a given state is not replaced by current()

    plain = disk_checkpoints(model, tokenizer, tmp_path / "b")
    paths = [plain() for _ in range(3)]
    assert torch.equal(saved(paths[-1]), base)
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["v000002", "v000003"]
    assert (Path(paths[-1]) / "tokenizer_config.json").exists()
