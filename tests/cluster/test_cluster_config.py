"""``[cluster]`` without a cluster: the single-process default never imports Ray, and the section refuses what it
cannot place (these run in the default suite; the real cluster is tests/cluster/test_ray_cluster.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_sdk.errors import ConfigError
from lightning_sdk.trainer.config import load_train_config
from tests.trainer.tiny import ROOT


def test_the_single_process_path_never_imports_ray() -> None:
    """Everything ``lightning-sdk train`` / ``daemon`` import to run in one process, in a fresh interpreter."""
    code = (
        "import sys; import lightning_sdk.app.job, lightning_sdk.app.daemon, lightning_sdk.app.train, "
        "lightning_sdk.app.parts, lightning_sdk.cli.daemon_cmd, lightning_sdk.cli.train_cmd, lightning_sdk.proxy; "
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_cluster_section_defaults_and_refusals(tmp_path: Path) -> None:
    (tmp_path / "train.toml").write_text('agent = "agent.py:agent"\n')
    config = load_train_config(tmp_path)
    assert config.cluster.ray is None and config.cluster.engine_resource == "GPU"
    placed = load_train_config(tmp_path, {"cluster.ray": "auto", "cluster.workers": "3"})
    assert placed.cluster.ray == "auto" and placed.cluster.workers == 3
    with pytest.raises(ConfigError, match=r"cluster\.ray"):
        load_train_config(tmp_path, {"cluster.ray": "auto", "engine.kind": "vllm", "engine.launch": "true"})
    with pytest.raises(ConfigError, match="engines"):
        load_train_config(tmp_path, {"cluster.engines": "0"})
    # the learner is an actor by default on a cluster; with LoRA it is refused at once (train it in the driver)
    assert placed.cluster.learner and placed.cluster.learner_resource is None
    with pytest.raises(ConfigError, match=r"cluster\.learner.*lora"):
        load_train_config(tmp_path, {"cluster.ray": "auto", "learner.lora.rank": "4"})
    alone = load_train_config(tmp_path, {"cluster.ray": "auto", "cluster.learner": "false", "learner.lora.rank": "4"})
    assert alone.learner.lora is not None and not alone.cluster.learner
