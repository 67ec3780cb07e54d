"""The training config is composed of the components' own models: every knob is settable from the file and with
``--set``, unknown keys name the valid ones, and docs/configuration.md is what the models say."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_sdk.errors import ConfigError
from lightning_sdk.policy.warm_start import WarmStartConfig
from lightning_sdk.trainer.config import TrainConfig, VerlSettings, WarmStartSettings, load_train_config
from lightning_sdk.trainer.learner import LearnerConfig
from lightning_sdk.trainer.verl.config import VerlConfig
from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def _script() -> object:
    return load_script(ROOT / "scripts" / "config_docs.py", "config_docs")


def test_docs_configuration_md_is_generated_from_the_models() -> None:
    script = _script()
    expected = script.render()  # type: ignore[attr-defined]
    assert (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8") == expected, (
        "docs/configuration.md is out of date: run python scripts/config_docs.py"
    )
    for key in ("clip_ratio_c", "weight_decay", "ppo_epochs", "mini_batches", "loss"):
        assert f"| `{key}` |" in expected


def test_sections_are_the_components_own_models() -> None:
    fields = TrainConfig.model_fields
    assert fields["learner"].annotation is LearnerConfig
    assert issubclass(WarmStartSettings, WarmStartConfig) and issubclass(VerlSettings, VerlConfig)
    assert set(WarmStartConfig.model_fields) <= set(WarmStartSettings.model_fields)
    assert set(VerlConfig.model_fields) <= set(VerlSettings.model_fields)


def _write(tmp_path: Path, text: str = "") -> Path:
    path = tmp_path / "train.toml"
    path.write_text('agent = "agent.py:agent"\n' + text)
    return path


def test_every_component_knob_is_settable_from_the_file_and_with_set(tmp_path: Path) -> None:
    path = _write(tmp_path, '[learner]\nclip_ratio_c = 2.5\nloss = "reinforce"\n[warm_start]\nseed = 7\n')
    overrides = {"learner.weight_decay": 0.1, "learner.betas": [0.9, 0.95], "learner.ppo_epochs": 2,
                 "warm_start.warmup_steps": 3, "rl.temperature": 0.7}  # fmt: skip
    cfg = load_train_config(path, overrides)
    assert (cfg.learner.clip_ratio_c, cfg.learner.loss, cfg.learner.weight_decay) == (2.5, "reinforce", 0.1)
    assert cfg.learner.betas == (0.9, 0.95) and cfg.learner.ppo_epochs == 2
    assert (cfg.warm_start.seed, cfg.warm_start.warmup_steps) == (7, 3)
    assert cfg.learner.temperature == 0.7  # the log-probs use the sampling temperature, settled at load
    verl = load_train_config(path, {"backend": "verl", "verl.weight_decay": 0.2, "verl.use_ray": False})
    assert verl.verl is not None and verl.verl.weight_decay == 0.2 and not verl.verl.use_ray


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"learner.lrr": 1.0}, "learner.lrr: unknown key (valid: lr, warmup_steps, weight_decay, betas, "),
        ({"rl.lr": 1.0}, "did you mean warm_start.lr or learner.lr or verl.lr?"),
        ({"enigne.kind": "vllm"}, "enigne: unknown key (valid: agent, name, base_dir, data, policy, warm_start"),
        ({"engine.kind": "tgi"}, "engine.kind: Input should be 'embedded', 'sglang' or 'vllm'"),
        ({"backend": "megatron"}, "backend: Input should be 'embedded' or 'verl'"),
        ({"learner.loss": "ppo"}, "unknown policy loss 'ppo'; valid: ppo_clip, reinforce"),
        ({"rl.estimator": "gae"}, "unknown estimator 'gae'; valid: "),
        ({"learner.temperature": 0.5}, "learner.temperature must equal rl.temperature"),
    ],
)
def test_config_errors_name_the_valid_values(tmp_path: Path, overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_train_config(_write(tmp_path), overrides)
    assert message in str(info.value)


def test_store_url_names_the_runs_store(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert load_train_config(_write(tmp_path)).store.spec(run_dir) == str(run_dir / "store.db")
    url = "postgresql://trainer@db.internal:5432/lightning"
    assert load_train_config(_write(tmp_path, f'[store]\nurl = "{url}"\n')).store.spec(run_dir) == url
    relative = load_train_config(_write(tmp_path), {"store.url": "shared/store.db"})
    assert relative.store.spec(run_dir) == str(tmp_path / "shared" / "store.db")  # relative to the config's folder
    with pytest.raises(ConfigError, match=r"store\.path"):
        load_train_config(_write(tmp_path, '[store]\npath = "x"\n'))
