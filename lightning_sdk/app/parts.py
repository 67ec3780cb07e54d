"""The one place that turns the ``[engine]`` and learner sections into the training parts: who serves the policy, who
updates it, and what the serving engine is handed after each update.

    [learner] / [verl] ─▶ learner  [learner]: ``Learner`` (torch, in process) | [verl]: ``VerlLearner`` (FSDP ranks)
    [engine]           ─▶ engine   embedded: ``EmbeddedEngine``     | sglang / vllm: servers at ``urls`` or launched
    both               ─▶ weights  embedded engine: a state dict in memory | sglang / vllm: a checkpoint dir on disk

The training loop (``app/loop.py``) only sees ``Parts``: it calls ``learner.step(records)``, ``weights()`` and
``engine.update_weights`` and never asks which backend or engine it has. The engine is ``[engine]``'s own
(``engines/serving.py`` ``open_engine``: remote engines are wrapped in ``ServedEngine``, which offers what the
trainer needs of an engine besides the ``Engine`` protocol). Sampling settings are not the engine's: the proxy
applies them per request, by the attempt's split (``proxy/sampling.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_sdk.engines.checkpoints import adapter_checkpoints, disk_checkpoints
from lightning_sdk.engines.serving import (
    EngineConfig,
    ServedEngine,
    ServingEngine,
    open_engine,
)
from lightning_sdk.errors import ConfigError
from lightning_sdk.policy.prepare import PolicyConfig
from lightning_sdk.trainer.config import ClusterConfig, PolicySettings, VerlSettings
from lightning_sdk.trainer.learner import Learner, LearnerConfig
from lightning_sdk.trainer.parts import LearnerLike, Parts, learner_elsewhere_parts

__all__ = ["LearnerLike", "Parts", "ServedEngine", "ServingEngine", "build_parts", "process_learner_parts"]


def build_parts(
    run_dir: Path,
    model_dir: Path,
    *,
    engine: EngineConfig,
    learner: LearnerConfig | VerlSettings,
    policy: PolicyConfig | None = None,
    cluster: ClusterConfig | None = None,
    policies: dict[str, PolicySettings] | None = None,
) -> Parts:
    """Engine + learner + weight publishing for ``model_dir``: the engine ``engine`` says (with ``cluster.ray``, the
    embedded engines as Ray actors: ``lightning_sdk/cluster``), the learner of the learner section handed over
    (``[learner]``: the embedded ``Learner``; ``[verl]``: verl's ranks, ``trainer/verl/adapter.py``; ``[cluster]
    learner``: the ``Learner`` as a Ray actor), and the chat template ``policy`` names. ``policies``
    (``[policies]``): several policies, each a LoRA adapter over this one base (``app/policies.py``). Servers this
    launched are stopped when a later part fails to build."""
    from lightning_sdk.memory import tune_for_policy
    from lightning_sdk.policy.model import load_policy, policy_renderer

    remote = engine.kind != "embedded"
    model, tokenizer = load_policy(model_dir)
    tune_for_policy(sum(p.numel() for p in model.parameters()))  # a small policy's malloc settings (memory.py)
    renderer = policy_renderer(policy or PolicyConfig(), tokenizer)
    if policies:
        if not isinstance(learner, LearnerConfig):
            raise ConfigError("[policies] needs the embedded learner ([learner], backend 'embedded')")
        from lightning_sdk.app.policies import policy_parts

        return policy_parts(
            model, tokenizer, renderer, policies, learner, max_batch_size=engine.max_batch_size, threads=engine.threads
        )
    served: ServingEngine
    if cluster is not None and cluster.ray and not remote:  # the engines as Ray actors where the GPUs are
        from lightning_sdk.cluster import RayEngine, connect

        connect(cluster.ray)
        served = RayEngine.launch(cluster, model_dir, tokenizer, max_batch_size=engine.max_batch_size)
    else:
        lora_rank = learner.lora.rank if isinstance(learner, LearnerConfig) and learner.lora is not None else None
        served = open_engine(engine, model, tokenizer, model_dir, lora_rank=lora_rank)
    with contextlib.ExitStack() as on_error:
        if isinstance(served, ServedEngine):
            on_error.callback(served.stop_servers)
        parts: Parts
        if isinstance(learner, VerlSettings):
            from lightning_sdk.trainer.verl.adapter import verl_parts

            parts = verl_parts(learner, run_dir, model_dir, served, tokenizer, remote=remote)
        elif cluster is not None and cluster.ray and cluster.learner:  # the learner as a Ray actor on its node
            from lightning_sdk.cluster import ray_learner_parts

            parts = ray_learner_parts(cluster, learner, model_dir, model, tokenizer, served)
        elif learner.process:  # the learner in a child process of its own (trainer/process.py)
            parts = process_learner_parts(learner, model_dir, model, tokenizer, served, engine)
        else:
            pad = tokenizer.pad_token_id
            trainer = Learner(model, learner, pad_id=int(pad) if pad is not None else 0)
            weights: Callable[[], Any] = trainer.weights
            # with LoRA the model holds PEFT's modules: a checkpoint is the merged state (the base model's names)
            lora = learner.lora is not None
            current = trainer.weights if lora else None
            if isinstance(served, ServedEngine) and lora and engine.kind == "vllm":
                # vLLM serves the adapter itself (runtime LoRA loading): each publication is the adapter alone,
                # loaded as a new adapter name (engines/vllm.py); a state dict handed by the warm start is the same
                # model's, whose adapter is the one written
                adapter = adapter_checkpoints(trainer.model, run_dir / "weights")
                served.write_state = lambda _state: adapter()
                weights = adapter
            elif isinstance(served, ServedEngine):
                writer = disk_checkpoints(model, tokenizer, run_dir / "weights", current=current)
                served.write_state = writer
                weights = lambda: writer(None)  # noqa: E731

            def save(out: Path) -> None:
                model.save_pretrained(str(out), state_dict=current() if current is not None else None)
                tokenizer.save_pretrained(str(out))

            parts = Parts(engine=served, learner=trainer, weights=weights, save_model=save, model=model)
        on_error.pop_all()
    parts.renderer = renderer
    return parts


def process_learner_parts(
    learner: LearnerConfig,
    model_dir: Path,
    model: Any,
    tokenizer: Any,
    served: ServingEngine,
    engine: EngineConfig,
) -> Parts:
    """The parts of a run whose embedded learner runs in a child process (``[learner] process``: ``ProcessLearner``):
    the engine gets the child's weights as a state dict; the parent keeps its copy of the policy for the warm start
    (the child gets its weights after it) and the save."""
    from lightning_sdk.trainer.process import ProcessLearner

    if engine.kind != "embedded":
        raise ConfigError("learner.process needs the embedded engine ([engine] kind = 'embedded')")
    if learner.lora is not None:
        raise ConfigError("learner.process with learner.lora: not supported yet (the learner trains in this process)")
    pad = tokenizer.pad_token_id
    child = ProcessLearner(model_dir, learner, model, pad_id=int(pad) if pad is not None else 0)
    return learner_elsewhere_parts(child, served, model, tokenizer)
