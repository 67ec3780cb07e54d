"""The one place that turns a ``TrainConfig`` into the training parts: who serves the policy, who updates it, and
what the serving engine is handed after each update.

    backend  ─▶ learner    embedded: ``Learner`` (torch, in process)  | verl: ``VerlLearner`` (verl's FSDP ranks)
    engine   ─▶ engine     embedded: ``EmbeddedEngine``                | sglang / vllm: servers at ``urls`` or launched
    both     ─▶ weights    embedded engine: a state dict in memory     | sglang / vllm: a checkpoint directory on disk

The training loop (``app/loop.py``) only sees ``Parts``: it calls ``learner.step(records)``, ``weights()`` and
``engine.update_weights`` and never asks which backend or engine it has. Remote engines are wrapped in
``ServedEngine`` so they offer what the trainer needs of an engine besides the ``Engine`` protocol (the tokenizer,
token counts). Sampling settings are not the engine's: the proxy applies them per request, by the attempt's split
(``proxy/sampling.py``).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import shutil
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lightning_sdk.engines.base import Engine, Generation, GenerationDelta, Sampling
from lightning_sdk.errors import ConfigError, EngineError, TokenizationError
from lightning_sdk.records.record import Record
from lightning_sdk.trainer.config import TrainConfig
from lightning_sdk.trainer.learner import Learner

if TYPE_CHECKING:
    from lightning_sdk.tokens import ChatRenderer

__all__ = [
    "LearnerLike",
    "Parts",
    "ServedEngine",
    "ServingEngine",
    "build_parts",
    "check_warm_start",
    "verl_config",
]

logger = logging.getLogger(__name__)


class ServingEngine(Engine, Protocol):
    """An ``Engine`` plus what the trainer uses: the tokenizer and ``stats["tokens"]`` (tokens generated so far)."""

    stats: dict[str, int]

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...


class LearnerLike(Protocol):
    """What the training loop asks of a learner (``Learner`` and ``VerlLearner`` both are one)."""

    steps: int

    def step(self, records: Sequence[Record]) -> dict[str, float]: ...

    def weights(self) -> dict[str, torch.Tensor]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ServedEngine:
    """A remote engine (SGLang/vLLM client) with the trainer's extras; stops the servers it launched on close."""

    def __init__(self, inner: Engine, tokenizer: PreTrainedTokenizerBase, servers: Sequence[Any] = ()) -> None:
        self.inner = inner
        self._tokenizer = tokenizer
        self._servers = list(servers)
        self.stats: dict[str, int] = {"tokens": 0, "requests": 0}
        # turns a state dict (what the warm start hands over) into a checkpoint directory the servers can load
        self.write_state: Callable[[dict[str, torch.Tensor]], str] | None = None

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    async def generate(self, input_ids: list[int], sampling: Sampling, *, session_id: str | None = None) -> Generation:
        self.stats["requests"] += 1
        gen = await self.inner.generate(input_ids, sampling, session_id=session_id)
        self.stats["tokens"] += len(gen.completion_ids)
        return gen

    async def stream(
        self, input_ids: list[int], sampling: Sampling, *, session_id: str | None = None
    ) -> AsyncIterator[GenerationDelta]:
        self.stats["requests"] += 1
        async for delta in self.inner.stream(input_ids, sampling, session_id=session_id):
            self.stats["tokens"] += len(delta.ids)
            yield delta

    async def update_weights(self, source: Any, version: int) -> None:
        if isinstance(source, dict):  # a state dict: servers load checkpoints from disk
            if self.write_state is None:
                raise EngineError("this engine loads weights from a checkpoint directory, not a state dict")
            source = await asyncio.to_thread(self.write_state, source)
        await self.inner.update_weights(source, version)

    async def close(self) -> None:
        await self.inner.close()
        self.stop_servers()

    def stop_servers(self) -> None:
        """Stop the servers this engine launched (none when it was given ``urls``)."""
        for server in self._servers:
            server.stop()
        self._servers = []


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

    async def close(self) -> None:
        """Close the engine (and the servers it launched), then shut the backend down."""
        await self.engine.close()
        for close in self.closers:
            close()


def verl_config(config: TrainConfig, model_dir: Path) -> Any:
    """The ``VerlConfig`` of ``backend: verl``: the ``[verl]`` section with the policy directory as ``model_dir`` and
    the sampling temperature."""
    from lightning_sdk.trainer.config import VerlSettings

    return (config.verl or VerlSettings()).verl_config(str(model_dir), config.rl.temperature)


def _remote_engine(config: TrainConfig, model_dir: Path, tokenizer: PreTrainedTokenizerBase) -> ServedEngine:
    from lightning_sdk.engines import launch

    ec = config.engine
    servers: list[Any] = []
    urls = list(ec.urls)
    if ec.launch:
        path = config.resolve(ec.model_path) if ec.model_path else str(model_dir)
        launcher = launch.launch_sglang if ec.kind == "sglang" else launch.launch_vllm
        gpus = ec.gpus or [[0]]
        kwargs: dict[str, Any] = {"extra_args": ec.extra_args}
        if ec.kind == "vllm" and ec.python:
            kwargs["python"] = ec.python
        servers = launch.launch_many(launcher, path, gpus=gpus, **kwargs)
        urls = [s.url for s in servers]
    inner: Engine
    if ec.kind == "sglang":
        from lightning_sdk.engines.sglang import SGLangEngine

        inner = SGLangEngine(urls)
    else:
        from lightning_sdk.engines.vllm import VLLMEngine

        inner = VLLMEngine(urls)
    logger.info("policy served by %s at %s", ec.kind, ", ".join(urls))
    return ServedEngine(inner, tokenizer, servers)


def _disk_weights(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, root: Path
) -> Callable[[dict[str, torch.Tensor] | None], str]:
    """``weights()`` of the embedded learner for a remote engine: an HF checkpoint per published version (the two
    newest are kept: the one being loaded and the one served before it)."""
    count = 0

    def write(state: dict[str, torch.Tensor] | None = None) -> str:
        """Save the model's current weights, or ``state`` (a state dict of the same model), as a checkpoint."""
        nonlocal count
        count += 1
        out = root / f"v{count:06d}"
        model.save_pretrained(str(out), state_dict=state)
        tokenizer.save_pretrained(str(out))
        old = root / f"v{count - 2:06d}"
        if count > 2 and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        return str(out)

    return write


def build_parts(config: TrainConfig, run_dir: Path, model_dir: Path) -> Parts:
    """Engine + learner + weight publishing for ``model_dir`` as ``config.backend`` and ``config.engine`` say."""
    from lightning_sdk.policy.model import load_policy

    remote = config.engine.kind != "embedded"
    model, tokenizer = load_policy(model_dir)
    renderer = policy_renderer(config, tokenizer)
    engine: ServingEngine
    if remote:
        engine = _remote_engine(config, model_dir, tokenizer)
    elif config.cluster.ray:  # the engines as Ray actors where the GPUs are (lightning_sdk/cluster)
        from lightning_sdk.cluster import RayEngine, connect

        connect(config.cluster.ray)
        engine = RayEngine.launch(config.cluster, model_dir, tokenizer, max_batch_size=config.engine.max_batch_size)
    else:
        from lightning_sdk.engines.embedded import EmbeddedEngine

        # the engine serves a copy of the policy; the embedded learner trains the original
        engine = EmbeddedEngine(
            copy.deepcopy(model),
            tokenizer,
            max_batch_size=config.engine.max_batch_size,
            threads=config.engine.threads,
        )
    if config.backend == "verl":
        try:
            parts = _verl_parts(config, run_dir, model_dir, engine, tokenizer, remote)
            parts.renderer = renderer
            return parts
        except BaseException:
            if isinstance(engine, ServedEngine):
                engine.stop_servers()
            raise
    pad = tokenizer.pad_token_id
    learner = Learner(model, config.learner_config(), pad_id=int(pad) if pad is not None else 0)
    weights: Callable[[], Any] = learner.weights
    if isinstance(engine, ServedEngine):
        writer = _disk_weights(model, tokenizer, run_dir / "weights")
        engine.write_state = writer
        # with LoRA the model holds PEFT's modules: the checkpoint is the merged state (the base model's names)
        lora = config.learner.lora is not None
        weights = lambda: writer(learner.weights() if lora else None)  # noqa: E731

    def save(out: Path) -> None:
        model.save_pretrained(str(out), state_dict=learner.weights() if config.learner.lora is not None else None)
        tokenizer.save_pretrained(str(out))

    return Parts(engine=engine, learner=learner, weights=weights, save_model=save, model=model, renderer=renderer)


def policy_renderer(config: TrainConfig, tokenizer: PreTrainedTokenizerBase) -> ChatRenderer:
    """The policy's chat template, probed and chosen (``ChatRenderer.for_policy``: ``policy.chat_template``, the
    model's own, or its family's tool format), set on ``tokenizer`` too: the warm start, the learner's checkpoints
    and the engines' copies then render with the template the proxy renders with."""
    from lightning_sdk.tokens import BUILTIN_TEMPLATES, ChatRenderer

    value = config.policy.chat_template
    if value is not None and value not in BUILTIN_TEMPLATES:
        value = config.resolve(value)
    try:
        renderer = ChatRenderer.for_policy(tokenizer, value, name=config.policy.model)
    except TokenizationError as exc:
        raise ConfigError(f"policy {config.policy.model!r}: {exc}") from exc
    tokenizer.chat_template = renderer.chat_template
    return renderer


def _verl_parts(
    config: TrainConfig,
    run_dir: Path,
    model_dir: Path,
    engine: ServingEngine,
    tokenizer: PreTrainedTokenizerBase,
    remote: bool,
) -> Parts:
    from lightning_sdk.trainer.config import VerlSettings
    from lightning_sdk.trainer.verl.adapter import VerlLearner
    from lightning_sdk.trainer.verl.backend import VerlBackend

    launch = config.verl or VerlSettings()
    pad = tokenizer.pad_token_id
    backend = VerlBackend(
        verl_config(config, model_dir),
        ray_address=launch.ray_address or config.cluster.ray,
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


def check_warm_start(config: TrainConfig, will_warm_start: bool) -> None:
    """A warm start trains a torch model in this process: only ``backend: embedded`` has one. Checked before
    anything is built, so the error comes at once."""
    if will_warm_start and config.backend != "embedded":
        raise ConfigError(
            f"warm_start needs backend 'embedded' (backend {config.backend!r} trains elsewhere): "
            "set [warm_start] enabled = false, or warm-start with the embedded backend first and point "
            "policy.model at its run's model/ directory"
        )
