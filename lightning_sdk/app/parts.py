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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lightning_sdk.engines.serving import (
    EngineConfig,
    ServedEngine,
    ServingEngine,
    adapter_checkpoints,
    disk_checkpoints,
    open_engine,
)
from lightning_sdk.errors import ConfigError
from lightning_sdk.policy.prepare import PolicyConfig
from lightning_sdk.records.record import Record
from lightning_sdk.trainer.config import ClusterConfig, PolicySettings, VerlSettings
from lightning_sdk.trainer.learner import Learner, LearnerConfig

if TYPE_CHECKING:
    from lightning_sdk.tokens import ChatRenderer

__all__ = ["LearnerLike", "Parts", "ServedEngine", "ServingEngine", "build_parts"]


class LearnerLike(Protocol):
    """What the training loop asks of a learner (``Learner`` and ``VerlLearner`` both are one)."""

    steps: int

    def step(self, records: Sequence[Record]) -> dict[str, float]: ...

    def weights(self) -> dict[str, Any]:  # a state dict (several policies: each policy's adapter state)
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class Parts:
    """What ``build_parts`` made. ``weights()`` is what ``engine.update_weights`` gets after a step (run it off the
    event loop: it may write a checkpoint); ``model`` is the torch model a warm start trains (None: the backend
    keeps its weights elsewhere, so no warm start)."""

    engine: ServingEngine
    learner: LearnerLike
    weights: Callable[[], Any]
    save_model: Callable[[Path], None]
    model: PreTrainedModel | None = None
    closers: list[Callable[[], None]] = field(default_factory=list)
    renderer: ChatRenderer | None = None  # the policy's template, probed (``ChatRenderer.for_policy``)
    policies: tuple[str, ...] = ()  # several policies in one run (``[policies]``: app/policies.py); empty: one

    async def close(self) -> None:
        """Close the engine (and the servers it launched), then shut the backend down."""
        await self.engine.close()
        for close in self.closers:
            close()


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
    (``[learner]``: the embedded ``Learner``; ``[verl]``: verl's ranks), and the chat template ``policy`` names.
    ``policies`` (``[policies]``): several policies, each a LoRA adapter over this one base (``app/policies.py``)."""
    from lightning_sdk.policy.model import load_policy, policy_renderer

    remote = engine.kind != "embedded"
    model, tokenizer = load_policy(model_dir)
    renderer = policy_renderer(policy or PolicyConfig(), tokenizer)
    if policies:
        if not isinstance(learner, LearnerConfig):
            raise ConfigError("[policies] needs the embedded learner ([learner], backend 'embedded')")
        return _policy_parts(model, tokenizer, renderer, policies, learner, engine)
    served: ServingEngine
    if cluster is not None and cluster.ray and not remote:  # the engines as Ray actors where the GPUs are
        from lightning_sdk.cluster import RayEngine, connect

        connect(cluster.ray)
        served = RayEngine.launch(cluster, model_dir, tokenizer, max_batch_size=engine.max_batch_size)
    else:
        lora_rank = learner.lora.rank if isinstance(learner, LearnerConfig) and learner.lora is not None else None
        served = open_engine(engine, model, tokenizer, model_dir, lora_rank=lora_rank)
    if isinstance(learner, VerlSettings):
        try:
            parts = _verl_parts(learner, run_dir, model_dir, served, tokenizer, remote)
            parts.renderer = renderer
            return parts
        except BaseException:
            if isinstance(served, ServedEngine):
                served.stop_servers()
            raise
    pad = tokenizer.pad_token_id
    if cluster is not None and cluster.ray and cluster.learner:  # the learner as a Ray actor on its node
        return _ray_learner_parts(cluster, learner, model_dir, model, tokenizer, served, renderer)
    trainer = Learner(model, learner, pad_id=int(pad) if pad is not None else 0)
    weights: Callable[[], Any] = trainer.weights
    # with LoRA the model holds PEFT's modules: a checkpoint is the merged state (the base model's names)
    lora = learner.lora is not None
    if isinstance(served, ServedEngine) and lora and engine.kind == "vllm":
        # vLLM serves the adapter itself (runtime LoRA loading): each publication is the adapter alone, loaded as a
        # new adapter name (engines/vllm.py); a state dict handed by the warm start is the same model's, whose
        # adapter is the one written
        adapter = adapter_checkpoints(trainer.model, run_dir / "weights")
        served.write_state = lambda _state: adapter()
        weights = adapter
    elif isinstance(served, ServedEngine):
        writer = disk_checkpoints(model, tokenizer, run_dir / "weights")
        served.write_state = writer
        weights = lambda: writer(trainer.weights() if lora else None)  # noqa: E731

    def save(out: Path) -> None:
        model.save_pretrained(str(out), state_dict=trainer.weights() if lora else None)
        tokenizer.save_pretrained(str(out))

    return Parts(engine=served, learner=trainer, weights=weights, save_model=save, model=model, renderer=renderer)


def _policy_parts(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    renderer: ChatRenderer,
    policies: dict[str, PolicySettings],
    learner: LearnerConfig,
    engine: EngineConfig,
) -> Parts:
    from lightning_sdk.app.policies import build_policies, save_policies

    engines, learners = build_policies(
        model, tokenizer, policies, learner, max_batch_size=engine.max_batch_size, threads=engine.threads
    )
    return Parts(
        engine=engines,
        learner=learners,
        weights=learners.weights,
        save_model=lambda out: save_policies(learners, model, tokenizer, out),
        model=None,  # no warm start: it would train the shared base
        renderer=renderer,
        policies=tuple(policies),
    )


def _ray_learner_parts(
    cluster: ClusterConfig,
    learner: LearnerConfig,
    model_dir: Path,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    served: ServingEngine,
    renderer: ChatRenderer,
) -> Parts:
    """The embedded learner as a Ray actor (``RayLearner``): its weights go to the engine actors by reference; the
    driver keeps its copy of the policy for the warm start (the actor gets its weights after it) and the save."""
    from lightning_sdk.cluster import RayLearner

    pad = tokenizer.pad_token_id
    actor = RayLearner.launch(cluster, model_dir, learner, model, pad_id=int(pad) if pad is not None else 0)
    return Parts(
        engine=served,
        learner=actor,
        weights=actor.weights,
        save_model=lambda out: actor.save(out, tokenizer),
        model=model,
        closers=[actor.close],
        renderer=renderer,
    )


def _verl_parts(
    launch: VerlSettings,
    run_dir: Path,
    model_dir: Path,
    engine: ServingEngine,
    tokenizer: PreTrainedTokenizerBase,
    remote: bool,
) -> Parts:
    from lightning_sdk.trainer.verl.adapter import VerlLearner
    from lightning_sdk.trainer.verl.backend import VerlBackend

    pad = tokenizer.pad_token_id
    backend = VerlBackend(
        launch.verl_config(str(model_dir)),
        ray_address=launch.ray_address,
        ray_num_cpus=launch.ray_num_cpus,
        use_ray=launch.use_ray,
        publish_dir=run_dir / "weights",
        pad_id=int(pad) if pad is not None else 0,
    )
    learner = VerlLearner(backend)

    def on_disk() -> str:
        return str(backend.save_weights())

    def save(out: Path) -> None:
        backend.ranks.call_all("save_hf", str(out))
        tokenizer.save_pretrained(str(out))

    return Parts(
        engine=engine,
        learner=learner,
        weights=on_disk if remote else learner.weights,
        save_model=save,
        model=None,
        closers=[backend.shutdown],
    )
