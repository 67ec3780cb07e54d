"""The training config: one flat, typed model per component, read from a TOML, YAML or JSON file.

``lightning-sdk train examples/calc_agent`` reads ``examples/calc_agent/train.toml`` (the first of ``train.toml``,
``train.yaml``, ``train.yml``, ``train.json`` in the directory). Paths and ``FILE.py:NAME`` references in the file
are relative to the file's directory. Every field has a default; the resolved config is logged and written to the
run directory.

The config is settled once, when it is built: every path and ``FILE.py:NAME`` reference becomes absolute (against
``base_dir``), and the log-prob temperature of ``[learner]`` / ``[verl]`` becomes ``rl.temperature`` (the sampling
temperature; setting a different one is refused). So each part is handed its own section, ready to use
(``app/job.py``): nothing downstream resolves a path or copies a field between sections.
"""

from __future__ import annotations

import json
import logging
import tomllib
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lightning_sdk.engines.serving import ENGINE_KINDS, EngineConfig
from lightning_sdk.errors import ConfigError
from lightning_sdk.policy.prepare import PolicyConfig
from lightning_sdk.policy.warm_start import WarmStartConfig
from lightning_sdk.telemetry.config import TelemetryConfig
from lightning_sdk.tokens import BUILTIN_TEMPLATES
from lightning_sdk.trainer.learner import LearnerConfig, LoraSettings
from lightning_sdk.trainer.verl.config import VerlConfig

__all__ = [
    "BACKENDS",
    "ENGINE_KINDS",
    "VERL_LAUNCH_KEYS",
    "ClusterConfig",
    "DataConfig",
    "EngineConfig",
    "EvalConfig",
    "PolicyConfig",
    "PolicySettings",
    "RLConfig",
    "StoreConfig",
    "TrainConfig",
    "VerlSettings",
    "WarmStartSettings",
    "load_train_config",
]

logger = logging.getLogger(__name__)

_CONFIG_NAMES = ("train.toml", "train.yaml", "train.yml", "train.json")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DataConfig(_Section):
    """Where tasks and demonstrations come from: a JSONL file or ``FILE.py:FUNCTION`` returning a list of dicts."""

    train: str | None = Field(None, description="RL tasks")
    heldout: str | None = Field(None, description="evaluation tasks (never trained on)")
    demonstrations: str | None = Field(None, description="chats for the warm start (and the tiny tokenizer)")
    validation: str | None = Field(
        None, description="tasks that decide when the warm start stops (train split, never held out)"
    )


class WarmStartSettings(WarmStartConfig):
    """The warm start's own config (``policy/warm_start.py``) plus whether to run it and on what."""

    enabled: bool = Field(True, description="run the warm start (needs data.demonstrations and backend 'embedded')")
    validation_tasks: int = Field(
        64, ge=1, description="without data.validation: validate on the last this many train tasks"
    )


class RLConfig(_Section):
    """The RL loop: GRPO over groups of ``samples_per_task`` rollouts, sampled at ``temperature``; the update itself
    is the learner's (``[learner]`` or ``[verl]``)."""

    steps: int = Field(60, ge=1, description="training steps")
    tasks_per_step: int = Field(16, ge=1, description="groups per step")
    samples_per_task: int = Field(8, ge=1, description="rollouts per group")
    max_staleness: int = Field(1, ge=0, description="drop groups sampled more than this many versions ago")
    estimator: str = Field("grpo", description="advantage estimator, by name (records/advantages.py)")
    drop_zero_variance: bool = Field(True, description="do not train groups whose rewards are all equal")
    train_single_groups: bool = Field(
        False,
        description="train groups with one trained rollout (no baseline: most estimators give it its raw reward); "
        "off by default",
    )
    turn_baseline: Literal["group", "turn"] = Field(
        "group",
        description="per-call rewards (per-turn credit): compare each call's return with every call of its group "
        "(group) or with the calls at the same turn of the group's other rollouts (turn; records/advantages.py)",
    )
    temperature: float = Field(1.0, gt=0, description="sampling temperature of RL rollouts (the learner uses it)")
    max_tokens: int = Field(64, ge=1, description="cap on the tokens of each RL completion")
    workers: int = Field(64, ge=1, description="in-process agent workers (train)")
    max_wall_s: float | None = Field(
        420.0,
        description="the whole run's wall budget: RL stops early enough for one more step and the final evaluation "
        "(its time: the slowest held-out evaluation so far), which, with target_gain, is a last target check "
        "(trainer/stopping.py WallBudget)",
    )
    seed: int = Field(0, description="torch seed and task sampling seed")
    target_gain: float | None = Field(
        None,
        description="stop RL once held-out success gained this much over the evaluation before RL (checked on "
        "held-out when fresh-task sampled success reaches before + gain + target_margin; trainer/stopping.py)",
    )
    target_margin: float = Field(0.0, description="see target_gain")
    check_min_steps: int = Field(
        5,
        ge=1,
        description="with target_gain: RL steps between two held-out checks, at least (the first: after RL began)",
    )
    recheck_min_steps: int = Field(
        2,
        ge=1,
        description="with target_gain: after a check that missed, a re-check where the held-out progress so far "
        "projects the target comes at least this many steps later (at most check_min_steps; trainer/stopping.py)",
    )
    check_max_steps: int | None = Field(
        None,
        ge=1,
        description="with target_gain: a held-out check at the latest this many RL steps after the last check (the "
        "first: after RL began), even where the sampled success has not reached the trigger; None: only the trigger "
        "and the projection (trainer/stopping.py)",
    )
    replay_share: float = Field(
        0.0, ge=0, le=1, description="share of new groups that replay a task whose last group had reward variance"
    )
    max_replays: int = Field(2, ge=0, description="replays of one task in a row (trainer/sampling.py)")
    screen_samples: int = Field(
        0,
        ge=0,
        description="start each group on a fresh task with this many rollouts and generate the rest only when "
        "their rewards differ; a group whose first rollouts all agree is screened out, never trained (0: whole "
        "groups at once; app/loop.py)",
    )
    generate_during_eval: bool = Field(
        True,
        description="lightning-sdk train: the RL workers generate train groups while held-out evaluations run "
        "(on the weights being evaluated; the learner is paused): they start with the evaluation before RL and go on "
        "through the target checks, so the steps after them find their groups ready (false: they start once RL "
        "starts and stop for each check; app/train.py, app/rl.py run_rl)",
    )

    @model_validator(mode="after")
    def _groups_of_one_are_asked_for(self) -> RLConfig:
        if self.samples_per_task == 1 and not self.train_single_groups:
            raise ValueError(
                "samples_per_task = 1 makes every group a group of one, which is not trained by default (no "
                "baseline): set train_single_groups = true with an estimator meant for it (e.g. "
                "reinforce_plus_plus_baseline), or samples_per_task >= 2"
            )
        return self

    @model_validator(mode="after")
    def _screening_fits_the_group(self) -> RLConfig:
        if self.screen_samples and not 2 <= self.screen_samples < self.samples_per_task:
            raise ValueError(
                f"screen_samples = {self.screen_samples} must be 0 (off) or at least 2 and below samples_per_task "
                f"({self.samples_per_task})"
            )
        if self.screen_samples and not self.drop_zero_variance:
            raise ValueError(
                "screen_samples leaves out the groups whose first rewards are all equal, which "
                "drop_zero_variance = false asks to train: set one of them"
            )
        return self

    @field_validator("estimator")
    @classmethod
    def _known_estimator(cls, value: str) -> str:
        from lightning_sdk.records.advantages import estimator_names

        if value not in estimator_names():
            raise ValueError(f"unknown estimator {value!r}; valid: {', '.join(estimator_names())}")
        return value


class EvalConfig(_Section):
    """Held-out evaluation before and after RL, through the proxy with the same agent code."""

    enabled: bool = Field(True, description="evaluate on data.heldout before and after RL")
    n: int = Field(200, ge=1, description="held-out tasks evaluated")
    temperature: float = Field(0.0, ge=0, description="evaluation sampling temperature (0: greedy)")
    max_tokens: int = Field(64, ge=1, description="cap on the tokens of each evaluation completion")
    workers: int = Field(64, ge=1, description="in-process agent workers (evaluation)")


Backend = Literal["embedded", "verl"]
"""``backend``: who does the policy update (the embedded torch ``Learner``, or verl's FSDP workers)."""
BACKENDS: tuple[str, ...] = get_args(Backend)
#: keys of ``[verl]`` that say how verl's ranks start (not part of ``VerlConfig``).
VERL_LAUNCH_KEYS = ("use_ray", "ray_address", "ray_num_cpus")


class VerlSettings(VerlConfig):
    """``[verl]``: verl's own config (``trainer/verl/config.py``; ``model_dir`` and ``temperature`` are set by the
    trainer) plus how its ranks start."""

    model_dir: str = Field("", description="set by the trainer (policy.model, warm-started): leave it out")
    use_ray: bool = Field(True, description="run the ranks as Ray actors (false: one rank in this process)")
    ray_address: str | None = Field(None, description="join this Ray cluster ('auto', 'ray://host:10001')")
    ray_num_cpus: int | None = Field(None, description="CPUs of a Ray started here")

    def verl_config(self, model_dir: str) -> VerlConfig:
        """The ``VerlConfig`` of a run: these settings (their temperature settled to ``rl.temperature`` by
        ``TrainConfig``) with the policy directory."""
        data = self.model_dump(exclude=set(VERL_LAUNCH_KEYS))
        return VerlConfig.model_validate({**data, "model_dir": model_dir})


class ClusterConfig(_Section):
    """``[cluster]``: place the parts on a Ray cluster (``lightning_sdk/cluster``; docs/scale-out.md). Without
    ``ray`` the job runs in one process, as always, and never imports Ray."""

    ray: str | None = Field(None, description="join this Ray cluster: 'auto' or HOST:PORT (None: one process)")
    engines: int = Field(1, ge=1, description="engine actors")
    engine_resource: str = Field("GPU", description="the resource an engine needs one of (where the GPUs are)")
    engine_cpus: float = Field(1.0, ge=0, description="CPUs each engine actor takes")
    engine_threads: int | None = Field(None, ge=1, description="torch threads of each engine")
    engine_retry_s: float = Field(
        120.0, gt=0, description="how long a call cut off by an engine's death waits for its restart and is re-sent"
    )
    learner: bool = Field(
        True, description="the embedded learner as an actor of its own (false: in the driver; verl: its own ranks)"
    )
    learner_resource: str | None = Field(None, description="a resource the learner actor needs one of (its node)")
    learner_cpus: float = Field(1.0, ge=0, description="CPUs the learner actor takes")
    proxies: int = Field(
        0, ge=0, description="proxy actors on CPU nodes the worker actors call (0: they call the daemon's proxy)"
    )
    proxy_cpus: float = Field(1.0, ge=0, description="CPUs each proxy actor takes")
    proxy_resource: str | None = Field(None, description="a resource each proxy actor needs one of (CPU nodes)")
    workers: int = Field(1, ge=0, description="worker actors (each a pool of agent workers; 0: external workers)")
    worker_concurrency: int = Field(8, ge=1, description="agent workers in each worker actor")
    worker_cpus: float = Field(1.0, ge=0, description="CPUs each worker actor takes")
    lease_s: float = Field(30.0, gt=0, description="attempt lease of the worker actors (a dead one's are retried)")
    max_attempts: int = Field(3, ge=1, description="tries per train rollout (an attempt cut off by a death retries)")
    max_restarts: int = Field(5, ge=0, description="how often Ray restarts each actor that dies")
    start_timeout_s: float = Field(120.0, gt=0, description="how long the actors may take to start")


class StoreConfig(_Section):
    """Where the run's store lives: the run directory's SQLite file (the default), or a store that many proxies and
    hosts share (``url = "postgresql://user@host:5432/db"``; docs/scale-out.md)."""

    url: str | None = Field(
        None,
        description="a store spec (lightning_sdk.open_store): postgresql://USER@HOST:PORT/DB, or a SQLite file path "
        "(relative to the config's directory); default: RUN_DIR/store.db",
    )

    def spec(self, run_dir: Path) -> str:
        """What ``open_store`` opens for this run: ``url`` (a SQLite path made absolute when the config was loaded),
        else the run directory's ``store.db``."""
        return self.url or str(run_dir / "store.db")


class PolicySettings(_Section):
    """``[policies.NAME]``: one policy of a multi-policy run, a LoRA adapter over the one base model ``[policy]``
    names; requests choose it by ``model = "NAME"`` (app/policies.py, docs/training.md)."""

    lora: LoraSettings = Field(default_factory=LoraSettings, description="the policy's LoRA adapter over the base")


class TrainConfig(_Section):
    """The whole job: each section is its component's own config (``[learner]`` is ``LearnerConfig``,
    ``[warm_start]`` extends ``WarmStartConfig``, ``[verl]`` extends ``VerlConfig``), so every knob of every
    component is settable here and with ``--set section.key=value``."""

    agent: str = Field(description="the agent: FILE.py:NAME or module:NAME")
    name: str = Field("run", description="run name (default: the config's directory name)")
    base_dir: Path = Field(default_factory=Path.cwd, description="paths are relative to it (default: the config's)")
    data: DataConfig = Field(default_factory=DataConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    warm_start: WarmStartSettings = Field(default_factory=WarmStartSettings)
    rl: RLConfig = Field(default_factory=RLConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    backend: Backend = Field("embedded", description="embedded (torch, in process) or verl (FSDP ranks)")
    verl: VerlSettings | None = Field(None, description="backend verl only")
    engine: EngineConfig = Field(default_factory=EngineConfig)
    policies: dict[str, PolicySettings] = Field(
        default_factory=dict,
        description="several policies in one run ([policies.NAME] lora = {...}): each a LoRA adapter over the base, "
        "chosen by the request's model name, trained on its own calls; empty: one policy",
    )
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    host: str = Field("127.0.0.1", description="the proxy's bind address")
    port: int = Field(0, ge=0, le=65535, description="the proxy's port (0: a free one)")
    threads: int | None = Field(None, description="torch intra-op threads (default: torch's choice)")
    metrics: list[str] = Field(default_factory=list, description='extra metrics backends: "wandb", "mlflow"')

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.cluster.ray and self.engine.kind != "embedded":
            raise ValueError(
                "cluster.ray places embedded engines as Ray actors; with engine.kind "
                f"{self.engine.kind!r} the servers are given by engine.urls or engine.launch: leave cluster.ray out"
            )
        if self.policies:
            self._check_policies()
        if self.cluster.ray and self.cluster.learner and self.backend == "embedded" and self.learner.lora is not None:
            raise ValueError(
                "cluster.learner (the learner as a Ray actor) with learner.lora: not supported yet; "
                "set cluster.learner = false to train the adapter in the driver"
            )
        if self.verl is not None and self.backend != "verl":
            raise ValueError("a [verl] section needs backend = 'verl'")
        if self.verl is not None and "model_dir" in self.verl.model_fields_set:
            raise ValueError("verl.model_dir is set by the trainer (policy.model, warm-started); remove it")
        for section, cfg in (("learner", self.learner), ("verl", self.verl)):
            if cfg is not None and "temperature" in cfg.model_fields_set and cfg.temperature != self.rl.temperature:
                raise ValueError(
                    f"{section}.temperature must equal rl.temperature (the sampling temperature); leave it out"
                )
        return self

    def _check_policies(self) -> None:
        """What a multi-policy run needs: the embedded learner and engine in one process, each policy's own LoRA,
        and no warm start (it would train the shared base)."""
        needs = {
            "backend = 'embedded'": self.backend == "embedded",
            "engine.kind = 'embedded'": self.engine.kind == "embedded",
            "no cluster.ray": not self.cluster.ray,
            "no learner.lora (each [policies.NAME] sets its own lora)": self.learner.lora is None,
            "learner.kl_coef = 0": self.learner.kl_coef == 0,
            "warm_start.enabled = false (the warm start would train the shared base)": not self.warm_start.enabled,
        }
        missing = [k for k, ok in needs.items() if not ok]
        if missing:
            raise ValueError(f"[policies] (several policies in one run) needs {', '.join(missing)}")
        bad = [n for n in self.policies if not n or n != n.strip() or "/" in n or n == "__base__"]
        if bad:
            raise ValueError(f"[policies]: invalid policy names {bad} (a request's model name: no '/', no spaces)")

    @model_validator(mode="after")
    def _settle(self) -> TrainConfig:
        """Resolve every path once (see the module docstring) and give ``[learner]`` / ``[verl]`` the sampling
        temperature, so the sections are handed to their parts as they are. Idempotent: a settled config (e.g. the
        run directory's ``config.json``) settles to itself."""
        if _is_file_ref(self.agent):  # ``module:NAME`` is imported by name
            self.agent = self._resolve(self.agent)
        data = self.data
        for key in ("train", "heldout", "demonstrations", "validation"):
            ref = getattr(data, key)
            if ref:
                setattr(data, key, self._resolve(ref))
        if self.policy.is_path:
            self.policy.model = self._resolve(self.policy.model)
        template = self.policy.chat_template
        if template is not None and template not in BUILTIN_TEMPLATES:  # a Jinja file
            self.policy.chat_template = self._resolve(template)
        if self.engine.model_path:
            self.engine.model_path = self._resolve(self.engine.model_path)
        url = self.store.url
        if url and "://" not in url and url != "memory":  # a SQLite file
            self.store.url = self._resolve(url)
        self.learner.temperature = self.rl.temperature
        if self.backend == "verl" and self.verl is None:
            self.verl = VerlSettings()
        if self.verl is not None:
            self.verl.temperature = self.rl.temperature
            if self.verl.ray_address is None and self.cluster.ray:  # verl's ranks join the job's cluster
                self.verl.ray_address = self.cluster.ray
        return self

    def _resolve(self, ref: str) -> str:
        """A file reference relative to the config's directory (``FILE.py:NAME`` keeps its ``:NAME``)."""
        path, sep, attr = ref.partition(":") if ".py:" in ref else (ref, "", "")
        p = Path(path)
        if not p.is_absolute():
            p = self.base_dir / p
        return f"{p}{sep}{attr}"


def _is_file_ref(ref: str) -> bool:
    """``FILE.py:NAME``, a path with a folder, or an agent config file (not ``module:NAME``)."""
    head = ref.rpartition(":")[0] if ":" in ref else ref
    return ".py:" in ref or "/" in head or Path(ref).suffix in (".yaml", ".yml", ".json")


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


def _section_model(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model that holds the key at ``loc`` (a path of field names into ``TrainConfig``)."""
    model: type[BaseModel] = TrainConfig
    for key in loc[:-1]:
        field = model.model_fields.get(str(key))
        if field is None:
            return None
        inner = [a for a in (field.annotation, *get_args(field.annotation)) if isinstance(a, type)]
        nested = next((a for a in inner if issubclass(a, BaseModel)), None)
        if nested is None:
            return None
        model = nested
    return model


def explain(error: Any) -> str:
    """One line per config error; an unknown key names the valid keys of its section (and where it lives when it
    belongs to another section, e.g. ``rl.lr`` -> ``learner.lr``)."""
    loc = tuple(error["loc"])
    where = ".".join(map(str, loc)) or "(top level)"
    if error["type"] != "extra_forbidden":
        return f"{where}: {error['msg']}"
    model = _section_model(loc)
    if model is None:
        return f"{where}: unknown key"
    key = str(loc[-1])
    homes = [name for name, f in TrainConfig.model_fields.items() if _has_key(f.annotation, key)]
    hint = f"; did you mean {' or '.join(f'{h}.{key}' for h in homes)}?" if homes and len(loc) > 1 else ""
    return f"{where}: unknown key (valid: {', '.join(model.model_fields)}){hint}"


def _has_key(annotation: Any, key: str) -> bool:
    return any(isinstance(a, type) and issubclass(a, BaseModel) and key in a.model_fields
               for a in (annotation, *get_args(annotation)))  # fmt: skip


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
        lines = "\n".join(f"  {explain(e)}" for e in exc.errors())
        raise ConfigError(f"invalid training config {path}:\n{lines}") from None
    logger.info("training config: %s", config.model_dump_json())
    return config
