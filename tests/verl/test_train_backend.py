"""``backend = "verl"`` in the training config: the same run (store, proxy, records, daemon) with verl's FSDP worker
doing the update, and the config errors around it.

The serving engine here is the embedded one, standing in for SGLang/vLLM (which need a GPU and cannot run on this
machine); the weights travel to it through ``Engine.update_weights`` exactly as they would to a server (a state
dict for the embedded engine, a checkpoint directory for a server: the latter is checked on its own below). verl
runs one FSDP2 rank in this process on the CPU platform of ``trainer/verl/_cpu_platform.py`` (``use_ray = false``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_sdk.app import run_training
from lightning_sdk.errors import ConfigError
from lightning_sdk.policy.model import load_policy
from lightning_sdk.store import open_store
from lightning_sdk.trainer.checkpoint import load_checkpoint
from lightning_sdk.trainer.config import load_train_config
from lightning_sdk.trainer.learner import token_logprobs
from lightning_sdk.types import Call
from tests.trainer.tiny import build_small_policy, write_config


@pytest.fixture(scope="module")
def small_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_small_policy(tmp_path_factory.mktemp("policy") / "tiny", hidden=32, layers=2)


VERL_CPU = {"device": "cpu", "use_ray": False, "lr": 0.05, "entropy_coeff": 0.05}


async def _policy_calls(db: Path) -> list[Call]:
    store = open_store(db)
    try:
        calls: list[Call] = []
        after: str | None = None
        while True:
            page, after = await store.list_rollouts(limit=100, after=after)
            for rollout in page:
                detail = await store.get_rollout(rollout.rollout_id)
                calls += [c for a in detail.attempts for c in a.calls if c.is_policy and c.completion_ids]
            if after is None:
                return calls
    finally:
        await store.close()


def _max_gap(model: torch.nn.Module, call: Call) -> float:
    """Largest |recorded log-prob - log-prob under ``model``| over the call's sampled tokens (temperature 1)."""
    ids = torch.tensor([call.prompt_ids + call.completion_ids])
    with torch.no_grad():
        lp, _ = token_logprobs(model, ids, torch.ones_like(ids))  # type: ignore[arg-type]
    ours = lp[0, len(call.prompt_ids) - 1 :]
    return float((ours - torch.tensor(call.logprobs)).abs().max())


async def test_train_with_the_verl_backend_serves_the_new_weights(tmp_path: Path, small_policy: Path) -> None:
    """Two RL steps end to end; verl's update bumps the policy version, and the engine samples step 2's rollouts
    from the updated weights (their recorded log-probs no longer match the initial policy; step 1's still do)."""
    config_path = _config(
        tmp_path,
        small_policy,
        'backend = "verl"',
        warm_start={"enabled": False},
        rl={
            "steps": 2,
            "tasks_per_step": 2,
            "samples_per_task": 2,
            "max_staleness": 0,  # step 2 trains on rollouts sampled after step 1's weights were served
            "workers": 4,
            "max_tokens": 16,
            "drop_zero_variance": False,
        },
        eval={"enabled": False},
        verl=VERL_CPU,
    )
    config = load_train_config(config_path)
    assert config.backend == "verl" and config.engine.kind == "embedded"
    out = tmp_path / "run"

    summary = await run_training(config, out)

    assert summary["steps"] == 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2]
    assert [r["step/policy_version"] for r in rows] == [1.0, 2.0]  # verl's own counter, in the step metrics
    assert all(r["grad_norm"] > 0 for r in rows)
    ckpt = load_checkpoint(out)
    assert ckpt is not None and ckpt.version == 2 and ckpt.learner["steps"] == 2

    initial, _ = load_policy(small_policy)
    trained, _ = load_policy(Path(summary["model_dir"]))  # written by verl's rank (save_hf)
    moved = [float((trained.state_dict()[k] - v).abs().max()) for k, v in initial.state_dict().items()]
    assert max(moved) > 1e-3

    calls = await _policy_calls(out / "store.db")
    by_version: dict[int, list[Call]] = {}
    for call in calls:
        by_version.setdefault(int(call.policy_version or 0), []).append(call)
    assert by_version.get(0) and by_version.get(1), sorted(by_version)
    assert max(_max_gap(initial, c) for c in by_version[0]) < 1e-3  # served the initial weights
    assert min(_max_gap(initial, c) for c in by_version[1]) > 1e-3  # served verl's step-1 weights


def _config(tmp_path: Path, policy: Path, top: str, **sections: dict[str, object]) -> Path:
    path = write_config(tmp_path / "train.toml", str(policy), **sections)
    path.write_text(top + "\n" + path.read_text())
    return path


@pytest.mark.parametrize(
    ("top", "sections", "message"),
    [
        ('backend = "megatron"', {}, "backend: Input should be 'embedded' or 'verl'"),
        ("", {"engine": {"kind": "tgi"}}, "engine.kind: Input should be 'embedded', 'sglang' or 'vllm'"),
        ("", {"engine": {"kind": "sglang"}}, "needs engine.urls (running servers) or engine.launch = true"),
        ("", {"engine": {"urls": ["http://x:1"]}}, "not 'embedded'"),
        ("", {"verl": {"device": "cpu"}}, "a [verl] section needs backend = 'verl'"),
        ('backend = "verl"', {"verl": {"n_gpu": 2}}, "verl.n_gpu: unknown key (valid: model_dir, device, n_gpus, "),
        ("", {"rl": {"lr": 0.1}}, "rl.lr: unknown key (valid: steps, "),
        ("", {"rl": {"clip_ratio_c": 2.0}}, "did you mean learner.clip_ratio_c"),
        ("", {"learner": {"loss": "ppo"}}, "unknown policy loss 'ppo'; valid: ppo_clip, reinforce"),
        ('backend = "verl"', {"verl": {"device": "tpu"}}, "verl.device: Input should be 'cuda' or 'cpu'"),
        ('backend = "verl"', {"verl": {"model_dir": "/m"}}, "verl.model_dir is set by the trainer"),
        ('backend = "verl"', {"verl": {"temperature": 0.7}}, "verl.temperature must equal rl.temperature"),
    ],
)
def test_config_errors_name_the_valid_values(
    tmp_path: Path, small_policy: Path, top: str, sections: dict[str, dict[str, object]], message: str
) -> None:
    path = _config(tmp_path, small_policy, top, **sections)
    with pytest.raises(ConfigError) as info:
        load_train_config(path)
    assert message in str(info.value)


def test_the_verl_section_reaches_verl_config(tmp_path: Path, small_policy: Path) -> None:
    """``[verl]`` is verl's own config (its defaults, our keys on top), with the policy directory and the sampling
    temperature (settled when the config is loaded); launch keys stay out of ``VerlConfig``."""
    path = _config(
        tmp_path,
        small_policy,
        'backend = "verl"',
        rl={"temperature": 0.7},
        verl={"device": "cpu", "use_ray": False, "lr": 3e-5, "clip_ratio_low": 0.1, "weight_decay": 0.01},
        **{"verl.overrides": {'"trainer.seed"': 7}},
    )
    section = load_train_config(path).verl
    assert section is not None and section.temperature == 0.7
    cfg = section.verl_config(str(small_policy))
    assert (cfg.lr, cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.weight_decay) == (3e-5, 0.1, 0.28, 0.01)
    assert cfg.temperature == 0.7 and not hasattr(cfg, "use_ray")
    assert cfg.device == "cpu" and cfg.overrides == {"trainer.seed": 7} and cfg.model_dir == str(small_policy)


async def test_warm_start_with_verl_is_refused_before_anything_is_built(tmp_path: Path, small_policy: Path) -> None:
    path = _config(tmp_path, small_policy, 'backend = "verl"', verl={"device": "cpu", "use_ray": False})
    with pytest.raises(ConfigError, match=r"warm_start needs backend 'embedded'"):
        await run_training(load_train_config(path), tmp_path / "run")
    assert not (tmp_path / "run" / "policy_init").exists() and not (tmp_path / "run" / "store.db").exists()


async def test_a_server_engine_gets_checkpoint_directories(tmp_path: Path, small_policy: Path) -> None:
    """With ``engine.kind = "sglang"`` the learner's weights are published as an HF checkpoint directory per
    version (what SGLang's ``update_weights_from_disk`` reads); no server is contacted by building the parts."""
    from lightning_sdk.app.parts import ServedEngine, build_parts
    from lightning_sdk.engines.embedded import EmbeddedEngine
    from lightning_sdk.engines.sglang import SGLangEngine

    path = _config(tmp_path, small_policy, "", engine={"kind": "sglang", "urls": ["http://127.0.0.1:9"]})
    config = load_train_config(path)
    parts = build_parts(tmp_path, small_policy, engine=config.engine, learner=config.learner)
    try:
        assert isinstance(parts.engine, ServedEngine) and isinstance(parts.engine.inner, SGLangEngine)
        assert parts.engine.inner.base_urls == ["http://127.0.0.1:9"]
        first, second = parts.weights(), parts.weights()
        assert Path(first).name == "v000001" and Path(second).name == "v000002"
        assert (Path(first) / "tokenizer.json").exists()
        model, tok = load_policy(small_policy)
        check = EmbeddedEngine(model, tok, device="cpu")
        await check.update_weights(second, 5)  # the directory is a loadable checkpoint
        assert check.policy_version == 5
        await check.close()
    finally:
        await parts.close()
